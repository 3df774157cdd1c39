"""Block masks: which key tiles a ``mask_mod`` makes visible to each query tile.

For every (batch entry, head, query tile of ``block_m`` rows) a block mask lists the key tiles
of ``block_n`` keys where ``mask_mod`` is true for some but not all (query, key) pairs
(*partial*: the kernel evaluates the mask per element there) and those where it is true for
all pairs (*full*: no per-element mask). Tiles in neither list are never loaded. Pairs outside
[0, seqlen_q) x [0, seqlen_k) do not count, so the last tile of each axis may be cut short.

:func:`block_mask` builds it with a generated kernel (templates/block_mask.cu.j2) on the GPU, or
in the CPU emulator for host arrays, evaluating ``mask_mod`` at every pair, and returns it for
reuse across calls and layers; :func:`block_mask_reference` is the NumPy builder (float64
evaluator) the tests hold it against. See docs/expressions.md.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernelgen.errors import InputError, InputTypeError
from kernelgen.kernels.expression_cuda import (
    expression_source,
    headers,
    input_params,
    input_struct_init,
)
from kernelgen.kernels.render import Param, render_template, template_hash
from kernelgen.references.expressions import check_input_arrays, evaluate
from kernelgen.runtime.array_ops import ArrayOps
from kernelgen.runtime.frameworks import Arrays, arrays_of, device_of, dtype_name, launch_arg
from kernelgen.runtime.host import NumpyArrays, as_numpy, is_host_array
from kernelgen.runtime.launch import MAX_GRID, compile_functions, import_cupy
from kernelgen.specs.expressions import Expression, checked_expression, inputs_from_arrays
from kernelgen.specs.forward import WGMMA_MAX_BLOCK_N, tile_size_problem
from kernelgen.version import __version__

TEMPLATE = "block_mask.cu.j2"
THREADS = 128  # threads of a builder block, which evaluates one query tile against every key tile
NO_TILE = -1  # list entries past a count
INT32_MAX = 2**31 - 1  # sizes reach the builder as int
OUTPUTS = ("partial_counts", "partial_indices", "full_counts", "full_indices")
LIBRARY_NAMES = {"numpy": "NumPy array", "torch": "torch tensor", "cupy": "CuPy array"}


REPR_MASK_CHARS = 60  # characters of mask_mod a BlockMask's repr shows


@dataclass(frozen=True, eq=False, repr=False)
class BlockMask:
    """The block mask of ``mask_mod`` for ``block_m`` x ``block_n`` tiles of a (batch, heads,
    seqlen_q, seqlen_k) problem. Arrays are int32 in the library that built it:

    - ``partial_counts`` (batch, heads, q_tiles): key tiles partly visible to each query tile;
      ``partial_indices`` (batch, heads, q_tiles, key_tiles): those tiles in ascending order,
      then -1.
    - ``full_counts``, ``full_indices``: the same for the fully visible key tiles.

    A batch (heads) of 1 holds for every batch entry (head): mask_mod was evaluated at b = 0
    (h = 0)."""

    mask_mod: Expression
    seqlen_q: int
    seqlen_k: int
    block_m: int
    block_n: int
    partial_counts: Any
    partial_indices: Any
    full_counts: Any
    full_indices: Any
    # Lists derived for the backward kernels' tiles (kernelgen.calls.backward_mask), built once per
    # mask and tile shape: a mask reused across layers is reused by their backward passes too.
    derived: dict[Any, Any] = field(default_factory=dict, init=False, repr=False)

    @property
    def batch(self) -> int:
        return int(self.partial_counts.shape[0])

    @property
    def heads(self) -> int:
        return int(self.partial_counts.shape[1])

    @property
    def q_tiles(self) -> int:
        return tiles(self.seqlen_q, self.block_m)

    @property
    def key_tiles(self) -> int:
        return tiles(self.seqlen_k, self.block_n)

    def tile_states(self) -> np.ndarray:
        """int8 (batch, heads, q_tiles, key_tiles) on the host: 0 hidden, 1 partial, 2 full."""
        states = np.zeros((self.batch, self.heads, self.q_tiles, self.key_tiles), dtype=np.int8)
        for indices, counts, state in (
            (self.partial_indices, self.partial_counts, 1),
            (self.full_indices, self.full_counts, 2),
        ):
            indices, counts = to_host(indices), to_host(counts)
            listed = np.arange(self.key_tiles) < counts[..., None]
            b, h, m, slot = np.nonzero(listed)
            states[b, h, m, indices[b, h, m, slot]] = state
        return states

    def check_fits(
        self, batch: int, heads: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int
    ) -> None:
        """Raise an InputError naming each difference when this mask cannot serve a call of
        (batch, heads, seqlen_q, seqlen_k) with ``block_m`` x ``block_n`` tiles (a batch or
        heads of 1 serves any)."""
        problems = []
        for name, own, call in (("batch", self.batch, batch), ("heads", self.heads, heads)):
            if own not in (1, call):
                problems.append(f"{name} {own} (the call has {call}; 1 broadcasts)")
        for name, own, call in (
            ("seqlen_q", self.seqlen_q, seqlen_q),
            ("seqlen_k", self.seqlen_k, seqlen_k),
            ("block_m", self.block_m, block_m),
            ("block_n", self.block_n, block_n),
        ):
            if own != call:
                problems.append(f"{name} {own} (the call has {call})")
        if problems:
            raise InputError(
                f"block_mask does not fit the call: it was built for {'; '.join(problems)}; "
                "build it with kernelgen.block_mask for the call's sizes and tile shape"
            )

    def check_arrays(self, library: str, device: int) -> None:
        """Raise an InputTypeError/InputError naming the list (``block_mask.full_counts``, ...)
        unless the mask's fields have their types and its four lists are int32 arrays of
        ``library`` ("numpy", "torch" or "cupy": q's) on ``device`` (-1: the host), of the
        shapes its sizes give, rows contiguous as the kernels index them. Metadata only."""
        if not isinstance(self.mask_mod, Expression):
            raise InputTypeError(
                f"block_mask.mask_mod has type {type(self.mask_mod).__name__}; expected a "
                "checked mask_mod (build block masks with kernelgen.block_mask)"
            )
        for name in ("seqlen_q", "seqlen_k", "block_m", "block_n"):
            value = getattr(self, name)
            if not _is_size(value):
                raise InputError(
                    f"block_mask.{name} is {value!r}; expected an integer from 1 to {INT32_MAX}"
                )
        counts = self.partial_counts
        _check_list_type("partial_counts", counts, library, device)
        if len(counts.shape) != 3:
            raise InputError(
                f"block_mask.partial_counts has shape {tuple(counts.shape)}; expected (batch, "
                "heads, query tiles)"
            )
        rows = (self.batch, self.heads, self.q_tiles)
        for name in OUTPUTS:
            array = getattr(self, name)
            _check_list_type(name, array, library, device)
            shape = rows if name.endswith("counts") else (*rows, self.key_tiles)
            if tuple(array.shape) != shape:
                raise InputError(
                    f"block_mask.{name} has shape {tuple(array.shape)}; expected {shape} "
                    f"((batch, heads, query tiles{'' if len(shape) == 3 else ', key tiles'}): "
                    f"seqlen_q={self.seqlen_q}, seqlen_k={self.seqlen_k} in {self.block_m} x "
                    f"{self.block_n} tiles)"
                )
            strides = element_strides(array)
            dense = _dense_strides(shape)
            if any(n > 1 and s != d for n, s, d in zip(shape, strides, dense, strict=True)):
                raise InputError(
                    f"block_mask.{name} has strides {strides} (elements); expected a "
                    f"C-contiguous array, strides {dense}"
                )

    def check_values(self) -> None:
        """Raise an InputError naming the first bad entry (``block_mask.partial_counts[0, 1,
        2]``), its value and what is allowed unless every count is within 0 .. key tiles and
        each row's listed key tiles are in range and strictly ascend, with no tile both partly
        and fully visible: what the kernels rely on to stay within the lists and the keys and
        to visit a tile at most once. Run by the lists' own library, reading back one small
        array (one synchronisation on a device); after :meth:`check_arrays`. Whether the lists
        match the mask_mod is not checked (rebuild the mask for that)."""
        ops = ArrayOps(self.partial_counts)
        key_tiles = self.key_tiles
        slots = ops.arange(key_tiles)
        flags, members = [], []
        for counts_name, indices_name in _LISTS:
            counts = ops.int64(getattr(self, counts_name))
            indices = ops.int64(getattr(self, indices_name))
            listed = slots < counts[..., None]
            outside = (indices < 0) | (indices >= key_tiles)
            flags += [
                (counts < 0) | (counts > key_tiles),
                listed & outside,
                listed[..., 1:] & (indices[..., 1:] <= indices[..., :-1]),
            ]
            members.append(_member_tiles(ops, listed & ~outside, indices, key_tiles))
        flags.append(members[0] & members[1])
        found = ops.first_true_each(flags)
        for check, flat in enumerate(found):
            if flat >= 0:
                raise InputError(self._bad_entry(ops, check, flat))

    def _bad_entry(self, ops: ArrayOps, check: int, flat: int) -> str:
        """The message of ``check_values``' check number ``check`` (per list: count, index,
        order; then partial and full both) failing at flat index ``flat`` of its flags."""
        key_tiles = self.key_tiles
        rows = (self.batch, self.heads, self.q_tiles)
        if check == 6:
            *row, tile = np.unravel_index(flat, (*rows, key_tiles))
            where = ", ".join(str(int(x)) for x in row)
            return (
                f"block_mask lists key tile {int(tile)} in both block_mask.partial_indices"
                f"[{where}] and block_mask.full_indices[{where}]; a tile is partly or fully "
                "visible, not both"
            )
        counts_name, indices_name = _LISTS[check // 3]
        kind = check % 3
        if kind == 0:
            at = tuple(int(x) for x in np.unravel_index(flat, rows))
            value = int(ops.host(getattr(self, counts_name)[at]))
            return (
                f"block_mask.{counts_name}[{', '.join(map(str, at))}] is {value}; allowed 0 to "
                f"{key_tiles} (the key tiles of seqlen_k={self.seqlen_k} in tiles of "
                f"{self.block_n} keys)"
            )
        shape = (*rows, key_tiles - 1) if kind == 2 else (*rows, key_tiles)
        *row, slot = (int(x) for x in np.unravel_index(flat, shape))
        slot += kind == 2  # the order flags compare each entry with the one before
        indices = ops.host(getattr(self, indices_name)[tuple(row)])
        count = int(ops.host(getattr(self, counts_name)[tuple(row)]))
        where = ", ".join(map(str, row))
        if kind == 1:
            return (
                f"block_mask.{indices_name}[{where}, {slot}] is {int(indices[slot])}; the first "
                f"{count} entries of that row (block_mask.{counts_name}[{where}]) must be key "
                f"tiles from 0 to {key_tiles - 1}"
            )
        return (
            f"block_mask.{indices_name}[{where}, {slot}] is {int(indices[slot])} after "
            f"{int(indices[slot - 1])}; the first {count} entries of that row "
            f"(block_mask.{counts_name}[{where}]) must be strictly ascending key tiles"
        )

    def __repr__(self) -> str:
        """One short line: sizes, tile shape, the mask and how many tiles the kernels visit (the
        arrays themselves are left out)."""
        text = self.mask_mod.text
        if len(text) > REPR_MASK_CHARS:
            text = text[: REPR_MASK_CHARS - 3] + "..."
        every = self.batch * self.heads * self.q_tiles * self.key_tiles
        partial = int(to_host(self.partial_counts).sum())
        full = int(to_host(self.full_counts).sum())
        density = (partial + full) / every if every else 0.0
        return (
            f"BlockMask(shape=({self.batch}, {self.heads}, {self.seqlen_q}, {self.seqlen_k}), "
            f"block={self.block_m}x{self.block_n}, mask_mod={text!r}, partial={partial}, "
            f"full={full} of {every} tiles, density={density:.3g})"
        )

    def visited_tiles(self) -> int:
        """Key tiles an attention kernel loads over all (batch, head, query tile) rows."""
        return int(to_host(self.partial_counts).sum() + to_host(self.full_counts).sum())


_LISTS = (("partial_counts", "partial_indices"), ("full_counts", "full_indices"))


def _is_size(value: Any) -> bool:
    """An integer (a NumPy one too, not a bool) from 1 to INT32_MAX: a size the builder takes."""
    return (type(value) is int or isinstance(value, np.integer)) and 1 <= value <= INT32_MAX


def _dense_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.insert(0, running)
        running *= size
    return tuple(strides)


def _member_tiles(ops: ArrayOps, take: Any, indices: Any, key_tiles: int) -> Any:
    """(rows, key_tiles) booleans: tile t is among the ``indices`` (..., key_tiles) of a row
    where ``take``, in the rows' flat order (a scatter into a spare column for the others)."""
    rows = int(np.prod(indices.shape[:-1]))
    member = ops.zeros_bool((rows, key_tiles + 1))
    targets = ops.xp.where(take, indices, key_tiles).reshape(rows, key_tiles)
    member[ops.arange(rows)[:, None], targets] = True
    return member[:, :key_tiles]


def _check_list_type(name: str, array: Any, library: str, device: int) -> None:
    """One of a block mask's lists: an int32 array of ``library`` on ``device``."""
    if not is_array(array):
        raise InputTypeError(
            f"block_mask.{name} has type {type(array).__name__}; expected an int32 array"
        )
    check_library(
        f"block_mask.{name}",
        array,
        "q",
        library,
        "build the block mask in q's library (pass mod_inputs, or like=q, of q's library to "
        "kernelgen.block_mask)",
    )
    if device_of(array) != device:
        raise InputTypeError(
            f"block_mask.{name} is on device {device_of(array)} but q is on device {device} "
            "(-1: the host); build the block mask on q's device"
        )
    if dtype_name(array.dtype) != "int32":
        raise InputTypeError(
            f"block_mask.{name} has dtype {dtype_name(array.dtype)}; expected int32"
        )


def check_library(label: str, array: Any, other: str, library: str, fix: str) -> None:
    """An InputTypeError naming ``label`` and ``other`` unless ``array`` is of ``library``
    (``other``'s: "numpy", "torch" or "cupy"); ``fix`` says what to pass instead."""
    own = arrays_of(array).name
    if own != library:
        raise InputTypeError(
            f"{label} is a {LIBRARY_NAMES.get(own, own)} but {other} is a "
            f"{LIBRARY_NAMES.get(library, library)}; {fix}"
        )


def tiles(length: int, tile: int) -> int:
    return -(-length // tile)


def to_host(array: Any) -> np.ndarray:
    """A NumPy copy or view of a NumPy, CuPy or torch array."""
    if isinstance(array, np.ndarray):
        return array
    if type(array).__module__.split(".")[0] == "torch":
        return array.detach().cpu().numpy()
    return array.get()


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


def _check_sizes(sizes: Mapping[str, Any], block_m: Any, block_n: Any) -> None:
    for name, value in sizes.items():
        if not _is_size(value):
            raise InputError(
                f"{name}={value!r} is not allowed; use an integer from 1 to {INT32_MAX}"
            )
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        # the widest engine's tiles: wgmma's block-sparse kernels take key tiles up to 256
        problem = tile_size_problem(name, value, WGMMA_MAX_BLOCK_N)
        if problem:
            raise InputError(f"{problem}: the tiles of the kernel the block mask is for")
    grid = (tiles(int(sizes["seqlen_q"]), block_m), int(sizes["heads"]), int(sizes["batch"]))
    if any(size > limit for size, limit in zip(grid, MAX_GRID, strict=True)):
        raise InputError(
            f"the block-mask builder needs the grid (query tiles, heads, batch) = {grid}, over "
            f"CUDA's limit of {MAX_GRID}"
        )


def _library(mod_inputs: Mapping[str, Any], like: Any) -> tuple[Arrays, int]:
    """The library and device of the call: its inputs', else ``like``'s, else NumPy's (the CPU
    emulator). Every array, ``like`` included, must be of that library on that device."""
    named = [(f"mod_inputs[{name!r}]", array) for name, array in mod_inputs.items()]
    named += [("like", like)] if like is not None else []
    for label, array in named:
        if not is_array(array):
            raise InputTypeError(
                f"{label} is {type(array).__name__}; pass a NumPy, CuPy or torch array"
            )
    if not named:
        return NumpyArrays, -1
    first_label, first = named[0]
    library = arrays_of(first)
    device = device_of(first)
    for label, array in named[1:]:
        check_library(
            label,
            array,
            first_label,
            library.name,
            "every array of the call must be of one library",
        )
        if device_of(array) != device:
            raise InputTypeError(
                f"{label} is on device {device_of(array)}; every array of the call must be on "
                f"device {device} (-1: the host)"
            )
    return library, device


def is_array(value: Any) -> bool:
    """A host array, a torch tensor or a device array CuPy can view."""
    module = type(value).__module__.split(".")[0]
    return (
        is_host_array(value)
        or module in ("torch", "cupy")
        or hasattr(value, "__cuda_array_interface__")
        or hasattr(value, "__dlpack__")
    )


def element_strides(array: Any) -> tuple[int, ...]:
    if type(array).__module__.split(".")[0] == "torch":
        return tuple(array.stride())
    return tuple(s // array.dtype.itemsize for s in array.strides)


# --------------------------------------------------------------------------------------------
# The generated builder
# --------------------------------------------------------------------------------------------


def kernel_name(mask_mod: Expression, block_m: int, block_n: int, transposed: bool = False) -> str:
    """The builder's symbol: the mask_mod's hash (text and inputs), the tile shape and, for the
    transposed builder (lists of query tiles per key tile), ``_t``."""
    return f"kg_block_mask{'_t' if transposed else ''}_{mask_mod.hash}_m{block_m}_n{block_n}"


def builder_params(mask_mod: Expression) -> tuple[Param, ...]:
    """The builder kernel's parameters: the four outputs, the sizes, then the mod inputs."""
    params = [Param(name, "int*") for name in OUTPUTS]
    params += [Param(name, "int") for name in ("seqlen_q", "seqlen_k", "num_listed_tiles")]
    params += [Param(name, ctype) for ctype, name in input_params(mask_mod.inputs)]
    return tuple(params)


def builder_source(
    mask_mod: Expression, block_m: int, block_n: int, transposed: bool = False
) -> str:
    """CUDA source of the block-mask builder of ``mask_mod`` for ``block_m`` x ``block_n``
    (``transposed``: a block per key tile listing query tiles)."""
    return render_template(
        TEMPLATE,
        name=kernel_name(mask_mod, block_m, block_n, transposed),
        transposed=transposed,
        params=builder_params(mask_mod),
        headers=headers(mask_mod.inputs),
        expressions=expression_source(mask_mod),
        init=input_struct_init(mask_mod.inputs),
        block_m=block_m,
        block_n=block_n,
        threads=THREADS,
        generator_version=__version__,
        template_hash=template_hash()[:16],
    )


_FUNCTIONS: dict[tuple[str, str, int], Any] = {}  # (symbol, templates, device) -> function
_FUNCTIONS_LOCK = threading.Lock()


def _builder_function(
    mask_mod: Expression, block_m: int, block_n: int, device: int, transposed: bool = False
) -> Any:
    """The compiled builder, once per process and device (device -1: the emulator's build)."""
    name = kernel_name(mask_mod, block_m, block_n, transposed)
    key = (name, template_hash(), device)
    function = _FUNCTIONS.get(key)
    if function is None:
        with _FUNCTIONS_LOCK:
            function = _FUNCTIONS.get(key)
            if function is None:
                source = builder_source(mask_mod, block_m, block_n, transposed)
                if device < 0:
                    from kernelgen.emulator import build_kernel

                    params = [(p.ctype, p.name) for p in builder_params(mask_mod)]
                    function = build_kernel(source, name, params)
                else:
                    function = compile_functions(import_cupy(), name, source, [name])[name]
                _FUNCTIONS[key] = function
    return function


def block_mask(
    mask_mod: str | Expression,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    *,
    block_m: int,
    block_n: int,
    mod_inputs: Mapping[str, Any] | None = None,
    like: Any = None,
) -> BlockMask:
    """The block mask of ``mask_mod`` (a string, or a checked mask_mod) over a (batch, heads,
    seqlen_q, seqlen_k) problem in ``block_m`` x ``block_n`` tiles, built by a generated kernel.

    ``mod_inputs`` maps the names mask_mod reads to arrays (their dtype and rank declare
    them). The call's library and device (those of the lists it returns) are the inputs',
    else ``like``'s (pass q: ``attention()`` takes block masks of q's library and device), else
    NumPy's; every array, ``like`` included, must be of one library on one device. On host
    arrays the builder runs in the CPU emulator. ``batch`` or ``heads`` of 1: the mask is
    evaluated at b = 0 (h = 0) and holds for every batch entry (head). mask_mod's indices are
    absolute: q_idx in [0, seqlen_q), kv_idx in [0, seqlen_k)."""
    sizes = {"batch": batch, "heads": heads, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}
    _check_sizes(sizes, block_m, block_n)
    batch, heads, seqlen_q, seqlen_k = (int(v) for v in sizes.values())
    expression = checked_expression("mask_mod", mask_mod, inputs_from_arrays(mod_inputs))
    outputs = run_builder(
        expression, (batch, heads, seqlen_q, seqlen_k), block_m, block_n, dict(mod_inputs or {}),
        like, transposed=False,
    )  # fmt: skip
    return BlockMask(expression, seqlen_q, seqlen_k, block_m, block_n, **outputs)


def run_builder(
    expression: Expression,
    sizes: tuple[int, int, int, int],
    block_m: int,
    block_n: int,
    mod_inputs: dict[str, Any],
    like: Any,
    *,
    transposed: bool,
) -> dict[str, Any]:
    """The four lists of the (checked) builder call, by :data:`OUTPUTS` name: per (batch entry,
    head, query tile) key tiles, or with ``transposed`` per (batch entry, head, key tile) query
    tiles, in the library and on the device of ``mod_inputs`` / ``like``."""
    batch, heads, seqlen_q, seqlen_k = sizes
    library, device = _library(mod_inputs, like)
    q_tiles, key_tiles = tiles(seqlen_q, block_m), tiles(seqlen_k, block_n)
    own, listed = (key_tiles, q_tiles) if transposed else (q_tiles, key_tiles)
    grid = (own, heads, batch)
    if own > MAX_GRID[0]:
        raise InputError(
            f"the block-mask builder needs {own} blocks along x, over CUDA's limit of {MAX_GRID[0]}"
        )
    function = _builder_function(expression, block_m, block_n, device, transposed)
    shapes = {
        "partial_counts": (batch, heads, own),
        "partial_indices": (batch, heads, own, listed),
        "full_counts": (batch, heads, own),
        "full_indices": (batch, heads, own, listed),
    }
    if library.host:
        outputs = {
            name: library.empty(shape, library.int32(), device) for name, shape in shapes.items()
        }
        args: list[Any] = [as_numpy(outputs[name]) for name in OUTPUTS]
        args += [seqlen_q, seqlen_k, listed]
        for spec in expression.inputs:
            array = mod_inputs[spec.name]
            args += [as_numpy(array), *array.shape, *element_strides(array)]
        function(grid=grid, block=THREADS, shared_mem=0, args=args)
        return outputs
    with library.scope(device):
        outputs = {
            name: library.empty(shape, library.int32(), device) for name, shape in shapes.items()
        }
        args = [launch_arg(library, outputs[name]) for name in OUTPUTS]
        args += [np.int32(seqlen_q), np.int32(seqlen_k), np.int32(listed)]
        for spec in expression.inputs:
            array = mod_inputs[spec.name]
            args.append(launch_arg(library, array))
            args += [np.int64(n) for n in (*array.shape, *element_strides(array))]
        function(grid, (THREADS, 1, 1), tuple(args))
    return outputs


# --------------------------------------------------------------------------------------------
# The NumPy builder
# --------------------------------------------------------------------------------------------


def _listed(flags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(counts, indices) of the true entries of ``flags`` along its last axis: ascending,
    padded with NO_TILE."""
    counts = flags.sum(axis=-1).astype(np.int32)
    order = np.argsort(~flags, axis=-1, kind="stable").astype(np.int32)
    slots = np.arange(flags.shape[-1])
    return counts, np.where(slots < counts[..., None], order, np.int32(NO_TILE))


def block_mask_reference(
    mask_mod: str | Expression,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    *,
    block_m: int,
    block_n: int,
    mod_inputs: Mapping[str, Any] | None = None,
) -> BlockMask:
    """:func:`block_mask` computed by NumPy from the float64 evaluator (host arrays in and
    out), one query tile at a time."""
    sizes = {"batch": batch, "heads": heads, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}
    _check_sizes(sizes, block_m, block_n)
    expression = checked_expression("mask_mod", mask_mod, inputs_from_arrays(mod_inputs))
    mod_inputs = dict(mod_inputs or {})
    arrays = check_input_arrays(expression.inputs, {k: to_host(v) for k, v in mod_inputs.items()})
    q_tiles, key_tiles = tiles(seqlen_q, block_m), tiles(seqlen_k, block_n)
    visible = np.zeros((batch, heads, q_tiles, key_tiles), dtype=np.int64)
    b = np.arange(batch).reshape(-1, 1, 1, 1)
    h = np.arange(heads).reshape(1, -1, 1, 1)
    kv = np.arange(seqlen_k).reshape(1, 1, 1, -1)
    key_tile_of = np.arange(seqlen_k) // block_n
    for m in range(q_tiles):
        rows = np.arange(m * block_m, min((m + 1) * block_m, seqlen_q)).reshape(1, 1, -1, 1)
        mask = evaluate(expression, b=b, h=h, q_idx=rows, kv_idx=kv, inputs=arrays)
        mask = np.broadcast_to(mask, (batch, heads, rows.size, seqlen_k)).sum(axis=2)
        np.add.at(visible[:, :, m, :], (slice(None), slice(None), key_tile_of), mask)
    rows_in = np.minimum(block_m, seqlen_q - np.arange(q_tiles) * block_m)
    keys_in = np.minimum(block_n, seqlen_k - np.arange(key_tiles) * block_n)
    pairs = rows_in[:, None] * keys_in[None, :]  # (q_tiles, key_tiles) pairs inside the problem
    partial_counts, partial_indices = _listed((visible > 0) & (visible < pairs))
    full_counts, full_indices = _listed(visible == pairs)
    return BlockMask(
        expression,
        int(seqlen_q),
        int(seqlen_k),
        block_m,
        block_n,
        partial_counts,
        partial_indices,
        full_counts,
        full_indices,
    )


__all__ = ["BlockMask", "block_mask", "block_mask_reference", "builder_source"]
