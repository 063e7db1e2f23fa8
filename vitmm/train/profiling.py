"""Where a compiled step spends its time: device time per HLO op, grouped by kind and by module.

``profile_ops(run_step, hlo_text, steps)`` runs ``run_step`` (one step, blocking) ``steps`` times
under ``jax.profiler.trace``, reads the trace back (``jax.profiler.ProfileData``), and attributes
every event that carries an ``hlo_op`` of the step's module to the instruction of that name in the
compiled HLO (``jitted.lower(...).compile().as_text()``). Each instruction gets

- a **kind**: ``matmul`` (dots, cuBLAS/Triton GEMMs, fusions around a dot), ``attention`` (cuDNN
  or other fused attention kernels), ``conv``, ``fusion`` (elementwise and reductions), ``copy``
  (copies, transposes), ``collective``, or its opcode;
- a **pass** and **module** from its ``op_name`` metadata: ``jit(step)/jvp(ViT)/encoder/block_03/
  mlp/fc1/dot_general`` is the forward of ``encoder/block_*/mlp/fc1`` (block numbers collapse so a
  layer type sums over depth), ``transpose(jvp(...))`` the backward, and anything outside a model
  (``jit(step)/add``: loss, optimizer update) is ``other``. An instruction without metadata
  takes its fused computation's, or else its operands'.

On a GPU the events are kernels on the device's streams, so their times add up to the busy time
of the step. On XLA:CPU they are thunks on the host's threads: several can overlap, and a dot's
event ends when its asynchronous Eigen contraction is launched, not when it finishes, so CPU
tables under-count matmuls (the tests use CPU only to check the attribution).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax

_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\(")
_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS_RE = re.compile(r"calls=%?([\w.\-]+)")
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
_OPERAND_RE = re.compile(r"%([\w.\-]+)")
_MODULE_RE = re.compile(r"^HloModule\s+([\w.\-]+)")
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_BACKEND_KIND_RE = re.compile(r'"kind":"([^"]+)"')
_ATTENTION_MARKS = ("fmha", "flash")
_GEMM_MARKS = ("cublas", "gemm", "cutlass", "nvjet", "xmma", "gemv", "matmul")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True)
class HloOp:
    name: str
    opcode: str
    kind: str
    phase: str  # "forward", "backward" or "other"
    module: str  # e.g. "encoder/block_*/attn/qkv"; "" outside any model


def time_step(step: Callable, state, batch, steps: int, repeats: int) -> tuple[list[float], Any]:
    """Seconds per step of ``state, out = step(state, batch)`` (the state donated or not): two
    warm-up calls (compilation; the second with donated buffers), then ``repeats`` timings of
    ``steps`` back-to-back calls, blocking only at the end of each; the times and the last state."""
    for _ in range(2):
        state, out = step(state, batch)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            state, out = step(state, batch)
        jax.block_until_ready((state, out))
        times.append((time.perf_counter() - start) / steps)
    return times, state


def hlo_module_name(hlo_text: str) -> str:
    match = _MODULE_RE.search(hlo_text)
    if not match:
        raise ValueError("No 'HloModule <name>' header in the HLO text; pass compiled.as_text().")
    return match.group(1)


def source_of(op_name: str) -> tuple[str, str]:
    """``op_name`` metadata → ``(phase, module)``: ``("backward", "encoder/block_*/norm1")`` for
    ``jit(step)/transpose(jvp(ViT))/encoder/block_00/norm1/add_any``."""
    parts = op_name.split("/")
    wrapped = [i for i, part in enumerate(parts) if "(" in part]  # jit(step), jvp(ViT), transpose(…)
    if not any("jvp(" in parts[i] for i in wrapped):
        return "other", ""
    phase = "backward" if any("transpose(" in parts[i] for i in wrapped) else "forward"
    # a custom JVP inside the model repeats the name stack after its own jvp(…): keep the last copy
    path = [re.sub(r"^block_\d+$", "block_*", p) for p in parts[wrapped[-1] + 1:-1]]
    # scan/remat scopes and flax method scopes ("ViT._stem") say nothing about the layer
    path = [p for p in path if p not in ("while", "body", "cond", "checkpoint", "rematted_computation")
            and "." not in p]
    return phase, "/".join(path)


def _kind(opcode: str, line: str, fused_opcodes: set[str]) -> str:
    # what runs: a custom call's target, or the backend kind of a custom fusion (cuDNN, Triton);
    # never the op_name metadata, which names the Python source, not the kernel
    target = _TARGET_RE.search(line) if opcode == "custom-call" else _BACKEND_KIND_RE.search(line)
    target = target.group(1).lower() if target else ""
    if any(mark in target for mark in _ATTENTION_MARKS):
        return "attention"
    if any(mark in target for mark in _GEMM_MARKS):
        return "matmul"
    if "conv" in target:
        return "conv"
    if opcode in ("dot", "dot-general") or "dot" in fused_opcodes:
        return "matmul"
    if opcode == "convolution" or "convolution" in fused_opcodes:
        return "conv"
    if opcode in ("copy", "transpose", "copy-start", "copy-done") or (
            opcode == "fusion" and fused_opcodes and fused_opcodes <= {"copy", "transpose", "bitcast", "parameter"}):
        return "copy"
    if any(opcode.startswith(c) for c in _COLLECTIVES):
        return "collective"
    if opcode == "fusion":
        return "fusion"
    return opcode


def parse_hlo_ops(hlo_text: str) -> dict[str, HloOp]:
    """Every instruction of an HLO module's text, by name, with its kind, phase and module."""
    computations: dict[str, list[tuple[str, str, str]]] = collections.defaultdict(list)
    current = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():
            match = _COMP_RE.match(line)
            current = match.group(1) if match and not line.startswith("HloModule") else None
            continue
        match = _INSTR_RE.match(line)
        if match and current is not None:
            computations[current].append((match.group(1), match.group(2), line))

    def opcodes_under(comp: str, seen: set[str]) -> set[str]:
        if comp in seen:
            return set()
        seen.add(comp)
        found = set()
        for _, opcode, line in computations.get(comp, ()):
            found.add(opcode)
            for called in _CALLS_RE.findall(line):
                found |= opcodes_under(called, seen)
        return found

    lines = {name: line for instructions in computations.values() for name, _, line in instructions}

    def op_name_of(name: str, depth: int = 0) -> str | None:
        """The instruction's own ``op_name``; else its fused computation's; else its operands'
        (XLA:CPU's ``wrapped_reduce-window`` fusions, for one, carry no metadata)."""
        line = lines.get(name)
        if line is None or depth > 4:
            return None
        own = _OP_NAME_RE.search(line)
        if own:
            return own.group(1)
        for called in _CALLS_RE.findall(line):
            for _, _, inner in computations.get(called, ()):
                if inner_name := _OP_NAME_RE.search(inner):
                    return inner_name.group(1)
        opening = line.find("(", line.find("=") + 1)
        closing = line.find(")", opening)
        for operand in _OPERAND_RE.findall(line[opening:closing]):
            if found := op_name_of(operand, depth + 1):
                return found
        return None

    ops = {}
    for instructions in computations.values():
        for name, opcode, line in instructions:
            fused = set()
            if opcode == "fusion":
                for called in _CALLS_RE.findall(line):
                    fused |= opcodes_under(called, set())
            op_name = op_name_of(name)
            phase, module = source_of(op_name) if op_name else ("other", "")
            ops[name] = HloOp(name, opcode, _kind(opcode, line, fused), phase, module)
    return ops


def kernel_kind(kernel_name: str) -> str:
    """A kind for a device event that names no HLO op, from its kernel name."""
    low = kernel_name.lower()
    if any(mark in low for mark in ("fmha", "flash", "attention")):
        return "attention"
    if any(mark in low for mark in _GEMM_MARKS):
        return "matmul"
    if "conv" in low:
        return "conv"
    if "memcpy" in low or "memset" in low:
        return "copy"
    return "unattributed"


def trace_events(xspace_path: str, module: str) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """``(events of the module as (hlo_op, ns), other device kernels as (kernel name, ns))``.

    On GPU planes (``/device:…``) only the stream lines are read (derived lines repeat them)."""
    data = jax.profiler.ProfileData.from_file(xspace_path)
    ours, other = [], []
    for plane in data.planes:
        on_device = plane.name.startswith("/device:")
        if not on_device and plane.name != "/host:CPU":
            continue
        lines = list(plane.lines)
        if on_device and any(line.name.startswith("Stream") for line in lines):
            lines = [line for line in lines if line.name.startswith("Stream")]
        for line in lines:
            for event in line.events:
                stats = dict(event.stats)
                op = stats.get("hlo_op")
                if op is not None and stats.get("hlo_module", module) == module:
                    ours.append((str(op), float(event.duration_ns)))
                elif on_device and op is None:
                    other.append((event.name, float(event.duration_ns)))
    return ours, other


@dataclasses.dataclass
class OpProfile:
    """Device time per step by ``(kind, phase, module)``; ``wall_ms`` is the step's wall time."""

    steps: int
    wall_ms: float
    rows: dict[tuple[str, str, str], tuple[float, float]]  # key -> (ms per step, calls per step)
    unknown_ops: int  # events whose hlo_op is not in the HLO text

    @property
    def busy_ms(self) -> float:
        return sum(ms for ms, _ in self.rows.values())

    def by(self, *fields: str) -> list[tuple[tuple[str, ...], float, float]]:
        """Rows summed over the fields not named (``"kind"``, ``"phase"``, ``"module"``),
        largest first, as ``(key, ms per step, calls per step)``."""
        index = {"kind": 0, "phase": 1, "module": 2}
        out: dict[tuple[str, ...], list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
        for key, (ms, calls) in self.rows.items():
            acc = out[tuple(key[index[f]] for f in fields)]
            acc[0] += ms
            acc[1] += calls
        return sorted(((k, ms, calls) for k, (ms, calls) in out.items()), key=lambda r: -r[1])

    def to_markdown(self, *fields: str, top: int = 20) -> str:
        busy = self.busy_ms or 1.0
        lines = [f"| {' | '.join(fields)} | ms/step | share of busy | calls/step |",
                 "|" + "---|" * len(fields) + "---:|---:|---:|"]
        for key, ms, calls in self.by(*fields)[:top]:
            lines.append(f"| {' | '.join(k or '-' for k in key)} | {ms:.2f} | {ms / busy:.1%} | {calls:g} |")
        return "\n".join(lines)


def profile_ops(run_step: Callable[[], Any], hlo_text: str, steps: int = 5,
                logdir: str | None = None) -> OpProfile:
    """Trace ``steps`` calls of ``run_step`` (which must block until its step is done) and
    attribute device time to the ops of ``hlo_text`` (module docstring). Warm up before. The
    trace goes to ``logdir`` if given (for TensorBoard/XProf), else to a temporary folder."""
    if steps < 1:
        raise ValueError(f"steps={steps}: profile at least one step.")
    if logdir is None:
        with tempfile.TemporaryDirectory(prefix="vitmm_profile_") as tmp:
            return profile_ops(run_step, hlo_text, steps, tmp)
    module = hlo_module_name(hlo_text)
    ops = parse_hlo_ops(hlo_text)
    with jax.profiler.trace(logdir):
        start = time.perf_counter()
        for _ in range(steps):
            run_step()
        wall = (time.perf_counter() - start) / steps
    paths = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not paths:
        raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {logdir}.")
    ours, other = trace_events(paths[-1], module)
    rows: dict[tuple[str, str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    keyed = [((op.kind, op.phase, op.module) if (op := ops.get(name)) else ("unattributed", "other", name), ns)
             for name, ns in ours]
    unknown = sum(1 for name, _ in ours if name not in ops)
    keyed += [((kernel_kind(name), "other", "(kernels without an HLO op)"), ns) for name, ns in other]
    for key, ns in keyed:
        rows[key][0] += ns / 1e6 / steps
        rows[key][1] += 1 / steps
    return OpProfile(steps, wall * 1e3, {k: (v[0], v[1]) for k, v in rows.items()}, unknown)
