"""The offline compile cache (kernelgen.kernels.compile_cache): a hit gives back the compile's cubin
and ptxas report without NVRTC; an entry without the report does not serve a call that needs it;
a damaged entry is rebuilt with a warning; the cache can be turned off."""

from __future__ import annotations

import logging
import stat

import pytest
from conftest import require_toolchain

from kernelgen.kernels import compile as compile_module
from kernelgen.kernels import compile_cache as compile_cache
from kernelgen.kernels.compile import compile_offline, nvrtc_available

pytestmark = pytest.mark.compile

SOURCE = """
extern "C" __global__ void twice(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= 2.0f;
}
"""


@pytest.fixture
def nvrtc_calls(tmp_path, monkeypatch):
    """A fresh cache folder and a list that records each NVRTC compile."""
    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings, nvidia-cuda-nvrtc, headers)")
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "kg"))
    monkeypatch.delenv("KERNELGEN_COMPILE_CACHE", raising=False)
    calls: list[tuple[str, bool]] = []
    real = compile_module._nvrtc_compile

    def counted(nvrtc, source, name, arch, version, report):
        calls.append((arch, report))
        return real(nvrtc, source, name, arch, version, report)

    monkeypatch.setattr(compile_module, "_nvrtc_compile", counted)
    return calls


def entries(tmp_path):
    return sorted((tmp_path / "kg" / "nvrtc").glob("*.bin"))


def test_a_hit_gives_back_the_cubin_and_report_without_nvrtc(nvrtc_calls, tmp_path):
    first = compile_offline(SOURCE, "twice", "sm_80", sass=False)
    second = compile_offline(SOURCE, "twice", "sm_80", sass=False)
    assert nvrtc_calls == [("sm_80", True)]
    assert second.cubin == first.cubin and second.log == first.log
    assert second.resources == first.resources and first.resources.registers > 0
    (entry,) = entries(tmp_path)
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    assert stat.S_IMODE(entry.parent.stat().st_mode) == 0o700


def test_the_key_holds_source_name_and_arch(nvrtc_calls, tmp_path):
    compile_offline(SOURCE, "twice", "sm_80", sass=False)
    compile_offline(SOURCE, "twice", "sm_90", sass=False)
    compile_offline(SOURCE.replace("2.0f", "3.0f"), "twice", "sm_80", sass=False)
    assert [arch for arch, _ in nvrtc_calls] == ["sm_80", "sm_90", "sm_80"]
    assert len(entries(tmp_path)) == 3


def test_an_entry_without_the_report_does_not_serve_a_call_that_needs_it(nvrtc_calls):
    launch = compile_offline(SOURCE, "twice", "sm_80", report=False)
    assert launch.resources is None and "Used" not in launch.log
    reported = compile_offline(SOURCE, "twice", "sm_80", sass=False)
    assert reported.resources is not None and reported.resources.registers > 0
    again = compile_offline(SOURCE, "twice", "sm_80", report=False)  # the reported entry serves
    assert nvrtc_calls == [("sm_80", False), ("sm_80", True)]
    assert again.cubin == reported.cubin and again.resources is None


def test_a_damaged_entry_is_rebuilt_with_a_warning(nvrtc_calls, tmp_path, caplog):
    good = compile_offline(SOURCE, "twice", "sm_80", sass=False)
    (entry,) = entries(tmp_path)
    data = bytearray(entry.read_bytes())
    data[-1] ^= 0xFF  # the cubin's last byte: the checksum no longer matches
    entry.write_bytes(bytes(data))
    compile_cache._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="kernelgen.kernels.compile_cache"):
        rebuilt = compile_offline(SOURCE, "twice", "sm_80", sass=False)
    assert rebuilt.cubin == good.cubin and len(nvrtc_calls) == 2
    assert "does not match its checksum" in caplog.text
    assert entry.read_bytes()[-1] == good.cubin[-1]  # rewritten whole
    entry.write_bytes(b"garbage")
    compile_cache._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="kernelgen.kernels.compile_cache"):
        assert compile_offline(SOURCE, "twice", "sm_80", sass=False).cubin == good.cubin
    assert "not a kernelgen compile-cache file" in caplog.text and len(nvrtc_calls) == 3


@pytest.mark.parametrize("setting", ["0", "off"])
def test_the_cache_can_be_turned_off(nvrtc_calls, tmp_path, monkeypatch, setting):
    monkeypatch.setenv("KERNELGEN_COMPILE_CACHE", setting)
    for _ in range(2):
        compile_offline(SOURCE, "twice", "sm_80", sass=False)
    assert len(nvrtc_calls) == 2 and not (tmp_path / "kg").exists()


def test_an_unsafe_cache_folder_is_skipped_with_a_warning(nvrtc_calls, tmp_path, caplog):
    folder = tmp_path / "kg" / "nvrtc"
    folder.mkdir(parents=True)
    folder.chmod(0o777)  # others may write: never read from it
    with caplog.at_level(logging.WARNING, logger="kernelgen.kernels.compile"):
        compiled = compile_offline(SOURCE, "twice", "sm_80", sass=False)
    assert compiled.resources is not None and "compile cache off" in caplog.text
    assert not list(folder.iterdir())


@pytest.fixture
def disassemblies(nvrtc_calls, monkeypatch):
    """A list that records each run of the disassembler (cuobjdump -sass)."""
    require_toolchain(compile_module.cuobjdump_path() is not None, "cuobjdump and nvdisasm")
    calls: list[list[str]] = []
    real = compile_module.subprocess.run

    def counted(command, *args, **kwargs):
        if "-sass" in command:
            calls.append(command)
        return real(command, *args, **kwargs)

    monkeypatch.setattr(compile_module.subprocess, "run", counted)
    return calls


def sass_entries(tmp_path):
    return sorted((tmp_path / "kg" / "nvrtc" / "sass").glob("*.sass.z"))


def test_a_cubins_sass_is_disassembled_once_and_kept(disassemblies, tmp_path):
    cubin = compile_offline(SOURCE, "twice", "sm_80", sass=False).cubin
    first = compile_module.disassemble(cubin)
    assert "Function : twice" in first and "FADD" in first and len(disassemblies) == 1
    assert compile_module.disassemble(cubin) == first and len(disassemblies) == 1
    (kept,) = sass_entries(tmp_path)
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    other = compile_offline(SOURCE, "twice", "sm_90", sass=False).cubin  # another cubin
    assert compile_module.disassemble(other) != first and len(disassemblies) == 2
    assert len(sass_entries(tmp_path)) == 2


def test_a_damaged_sass_entry_is_disassembled_again_with_a_warning(disassemblies, tmp_path, caplog):
    cubin = compile_offline(SOURCE, "twice", "sm_80", sass=False).cubin
    good = compile_module.disassemble(cubin)
    (kept,) = sass_entries(tmp_path)
    kept.write_bytes(b"not zlib")
    compile_cache._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="kernelgen.kernels.compile_cache"):
        assert compile_module.disassemble(cubin) == good
    assert len(disassemblies) == 2 and "is ignored and rebuilt" in caplog.text
    assert compile_module.disassemble(cubin) == good and len(disassemblies) == 2  # rewritten


def test_sass_is_not_kept_with_the_cache_off(disassemblies, tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELGEN_COMPILE_CACHE", "0")
    cubin = compile_offline(SOURCE, "twice", "sm_80", sass=False).cubin
    assert compile_module.disassemble(cubin) == compile_module.disassemble(cubin)
    assert len(disassemblies) == 2 and not (tmp_path / "kg").exists()
