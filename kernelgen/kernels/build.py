"""Build generated/: readable sources named by URI plus a manifest of resources per architecture."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kernelgen.errors import SpecError
from kernelgen.families import AnySpec, load_any_spec, render_any
from kernelgen.fileio import atomic_write_text
from kernelgen.kernels.compile import Resources, compile_offline
from kernelgen.kernels.render import template_hash
from kernelgen.specs.arch import ARCHS
from kernelgen.specs.engines import required_sass_of
from kernelgen.version import __version__

MANIFEST = "manifest.json"


@dataclass
class BuiltKernel:
    spec: AnySpec
    source: str
    resources: list[Resources] = field(default_factory=list)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    def manifest_entry(self) -> dict[str, object]:
        return {
            "spec": self.spec.model_dump(mode="json"),
            "source": f"{self.spec.uri}.cu",
            "source_sha256": self.sha256,
            "smem_bytes": self.spec.smem_bytes,
            "threads": self.spec.threads,
            "resources": {r.arch: r.as_dict() for r in self.resources},
        }


# `kernelgen check` prints these even at 0 (and every other opcode family it counted that is not)
SASS_SHOWN = ("HMMA", "LDSM", "LDL", "STL")


def static_problems(spec: AnySpec, res: Resources) -> list[str]:
    """Why a compiled kernel fails the static bar on ``res.arch`` (empty: it passes):
    spill or stack bytes, shared memory over the arch's limit and, where the SASS was
    disassembled, local-memory loads/stores, a tensor-core spec without HMMA and LDSM or a
    wgmma spec without HGMMA and UTMALDG."""
    problems = []
    if res.spill_store_bytes or res.spill_load_bytes or res.stack_bytes:
        problems.append(
            f"ptxas on {res.arch}: {res.spill_store_bytes} B spill stores, "
            f"{res.spill_load_bytes} B spill loads, {res.stack_bytes} B stack "
            f"({res.registers} registers)"
        )
    smem, limit = spec.smem_bytes + res.static_smem_bytes, ARCHS[res.arch].max_smem_per_block
    if smem > limit:
        problems.append(f"{smem} B of shared memory, over the {limit}-byte limit of {res.arch}")
    sass = res.sass_instructions
    if sass and (sass.get("LDL", 0) or sass.get("STL", 0)):
        problems.append(
            f"local memory in the SASS for {res.arch} "
            f"(LDL {sass.get('LDL', 0)}, STL {sass.get('STL', 0)})"
        )
    required = required_sass_of(spec)
    if sass and required and not all(sass.get(name, 0) for name in required):
        problems.append(
            f"{spec.mma} spec without {' or '.join(required)} in its SASS for {res.arch}"
        )
    return problems


def load_specs(paths: list[Path]) -> list[AnySpec]:
    """Load every spec (of any family), collecting all problems (one line each) before raising."""
    specs, problems, seen = [], [], {}
    for path in paths:
        try:
            spec = load_any_spec(path)
        except SpecError as exc:
            problems += [f"{path}: {p}" for p in exc.problems]
            continue
        if spec.uri in seen:
            problems.append(f"{path}: same kernel ({spec.uri}) as {seen[spec.uri]}")
            continue
        seen[spec.uri] = path
        specs.append(spec)
    if problems:
        raise SpecError(problems)
    return specs


def build_kernels(
    specs: list[AnySpec],
    archs: list[str] | None,
    on_compiled: Callable[[str], None] | None = None,
) -> list[BuiltKernel]:
    """Render and compile each spec for its archs (or ``archs`` when given); ``on_compiled``
    hears each (spec, arch) compile as it finishes (the CLI's progress bar)."""
    built = []
    for spec in specs:
        kernel = BuiltKernel(spec, render_any(spec))
        for arch in archs or spec.archs:
            kernel.resources.append(compile_offline(kernel.source, spec.uri, arch).resources)
            if on_compiled is not None:
                on_compiled(f"{spec.uri} {arch}")
        built.append(kernel)
    return built


def read_manifest(out_dir: Path) -> tuple[dict, str | None]:
    """``out_dir``'s manifest and, when there is one kernelgen cannot use (not JSON, not an
    object with an object of kernel entries), why; then an empty manifest stands in for it."""
    path = out_dir / MANIFEST
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {"kernels": {}}, None
    except OSError as exc:
        return {"kernels": {}}, f"{path}: cannot read it ({exc.strerror or exc})"
    except (ValueError, RecursionError):
        return {"kernels": {}}, f"{path}: not JSON"
    kernels = data.get("kernels") if isinstance(data, dict) else None
    if not isinstance(kernels, dict) or not all(isinstance(e, dict) for e in kernels.values()):
        what = "an object of kernel entries" if isinstance(data, dict) else type(data).__name__
        return {"kernels": {}}, f"{path}: not a kernelgen manifest (a JSON {what} is expected)"
    return data, None


def write_generated(built: list[BuiltKernel], out_dir: Path) -> list[str]:
    """Write each source and merge the kernels into the manifest, every file atomically.
    Returns one warning per problem met (a corrupt manifest, replaced by a new one)."""
    manifest, problem = read_manifest(out_dir)
    warnings = [f"{problem}; replaced by a new one"] if problem else []
    for kernel in built:
        atomic_write_text(out_dir / f"{kernel.spec.uri}.cu", kernel.source)
        manifest["kernels"][kernel.spec.uri] = kernel.manifest_entry()
    manifest["generator_version"] = __version__
    manifest["template_hash"] = template_hash()
    # entries describe the sources beside them: one whose .cu is gone (its spec removed) goes
    manifest["kernels"] = {
        uri: entry
        for uri, entry in sorted(manifest["kernels"].items())
        if (out_dir / f"{uri}.cu").exists()
    }
    atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return warnings


def stale_files(specs: list[AnySpec], out_dir: Path, orphans: bool = True) -> list[str]:
    """What in ``out_dir`` does not match the specs (no compile needed): one line per problem.
    ``orphans``: also ``.cu`` files no given spec produces (when the specs are the whole set)."""
    manifest, problem = read_manifest(out_dir)
    problems = [f"{problem} (rebuild)"] if problem else []
    kernels = manifest["kernels"]
    wanted = set()
    for spec in specs:
        source = render_any(spec)
        path = out_dir / f"{spec.uri}.cu"
        wanted.add(path.name)
        if not path.exists():
            problems.append(f"{path}: missing")
        elif path.read_text() != source:
            problems.append(f"{path}: out of date with the spec or the templates")
        entry = kernels.get(spec.uri)
        if entry is None:
            problems.append(f"{out_dir / MANIFEST}: no entry for {spec.uri}")
        elif entry.get("source_sha256") != hashlib.sha256(source.encode()).hexdigest():
            problems.append(f"{out_dir / MANIFEST}: entry for {spec.uri} is out of date")
    for path in sorted(out_dir.glob("*.cu")) if orphans else []:
        if path.name not in wanted:
            problems.append(f"{path}: no spec produces it (delete it or add its spec)")
    for uri in sorted(kernels):
        if not (out_dir / f"{uri}.cu").exists():
            problems.append(f"{out_dir / MANIFEST}: entry for {uri} has no source (rebuild)")
    return problems
