"""Kernel census of a compiled step: kernels per named-scope block by kind, and device time per block.

`kernel_census(hlo_text, blocks)` reads the optimized HLO of one compiled program (e.g.
`jax.jit(f).lower(...).compile().as_text()`) and counts its *kernels*: the ops of the ENTRY
computation that launch work (fusions, dots, custom calls, collectives, copies, ...; not
parameters, constants, tuples, get-tuple-element, bitcasts, the `-done` halves of async pairs).
A `call` is opened and its ops are counted instead (some XLA versions outline GPU command buffers
as calls).  Kinds (KINDS): loop / input / output fusions; gemm (dots, convolutions, cuBLAS custom
calls, Triton gemm fusions); custom (other custom calls and custom fusions: __triton, YNNPACK,
a sort); collective (all-reduce, all-gather, ... and their -start, and our FFI collectives, the
jaxk3_* all-gather / all-reduce custom calls); copy; other.
Each kernel is attributed to a block by the named-scope path in its `op_name` metadata
(`jax.named_scope("layer3_mla")` puts `.../layer3_mla/...` there). A kernel whose op_name names
no block (XLA-made ops, e.g. CPU's bf16 -> f32 weight converts, whose op_name is just the jit
and shard_map scopes) takes the block of its first user that has one, else of its first operand
that has one, else stays in the row UNSCOPED; a GEMM the other way round, operand first (XLA's split-K
GEMV fusions carry no op_name, and their first user, the sum of their partials, may be the next block's).
Those inherited kernels are counted per block.

`profile_times(xplane_path, census, steps)` sums, per block, the duration of the device events of
that program in a `jax.profiler` trace: every event carrying the HLO instruction's name (the
`hlo_op` stat on CPU thunks, `hlo_op=` in the annotation of GPU kernels), on the GPU only on the
device planes; nested events (a thunk inside another counted one) are not counted twice.  It needs
only what jaxlib ships (`jax.profiler.ProfileData`), no TensorBoard plugin; when it cannot
attribute anything it raises `ProfileUnavailable` with the reason, and callers print that reason
instead of times.  Times are the sum of event durations per step per device, which on CPU (ops
of one step run concurrently on a thread pool) need not add up to the step's wall time.

`device_timeline(xplane_path, steps)` reads the same trace for how busy each GPU was: every event on its stream
lines (kernels replayed inside CUDA graphs included, which `profile_times` cannot place), their union against the
span from the first to the last, and the idle gaps between them by length (`busy_idle`).  A step whose time is its
kernels' own is busy throughout; launch latency or host pacing shows as idle gaps.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import warnings
from collections import Counter, defaultdict
from typing import Any, Iterable

# Kind columns, in table order.
KINDS = ("loop", "input", "output", "gemm", "custom", "collective", "copy", "other")
UNSCOPED = "(unscoped)"
UNATTRIBUTED = "(unattributed)"  # profile events whose op is not in the census (only in times)

_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                "add-dependency", "domain", "opt-barrier", "async-done", "async-update", "all-reduce-done",
                "all-gather-done", "collective-permute-done", "copy-done", "send-done", "recv-done",
                "optimization-barrier"}
_COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                "collective-permute", "collective-broadcast", "send", "recv"}
_GEMM_TARGETS = re.compile(r"cublas|gemm|matmul|cudnn\$conv|__onednn\$matmul", re.I)
_COLLECTIVE_TARGETS = re.compile(r"all_gather|all_reduce|psum|reduce_scatter|all_to_all|allreduce|allgather", re.I)
BLOCK_RE = re.compile(r"(?<![\w])(embed|head|layer\d+_(?:kda|mla|moe|mlp))(?![\w])")

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=%]+)\s*=\s*(?P<type>.*?)\s(?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$")
_DEPTH = {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}
_COMP = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[^\s(]+)\s*(?:\(.*)?\{\s*$")


@dataclasses.dataclass
class Instr:
    """One HLO instruction: its name, opcode, operand names, op_name metadata and the rest of its line."""
    name: str
    op: str
    operands: list[str]
    op_name: str
    attrs: str


@dataclasses.dataclass
class Kernel:
    """One counted kernel: the instruction, its kind (one of KINDS), detail (fusion kind, custom-call
    target, collective opcode), its block and whether the block was inherited from a user/operand."""
    name: str
    kind: str
    detail: str
    block: str
    inherited: bool = False


def parse_hlo(text: str) -> tuple[str, dict[str, list[Instr]], str]:
    """(module name, {computation name: instructions in order}, entry computation name) of HLO text."""
    m = re.search(r"^HloModule\s+([^\s,]+)", text, re.M)
    module = m.group(1) if m else ""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            c = _COMP.match(line)
            if c and not line.startswith((" ", "\t")):
                current = c.group("name")
                comps[current] = []
                if c.group("entry"):
                    entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        i = _INSTR.match(line)
        if i:
            rest = i.group("rest")
            args, attrs = _split_args(rest)
            meta = re.search(r'op_name="((?:[^"\\]|\\.)*)"', attrs)
            comps[current].append(Instr(i.group("name"), i.group("op"), args, meta.group(1) if meta else "", attrs))
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text (pass compiled.as_text())")
    return module, comps, entry


def _split_args(rest: str) -> tuple[list[str], str]:
    """The operand names of `rest` (the text after `opcode(`) and the attribute text after its `)`."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += _DEPTH.get(ch, 0)
        if depth == 0:
            end = i
            break
    inner, attrs = re.sub(r"/\*.*?\*/", "", rest[:end]), rest[end + 1:]
    names, depth, cur = [], 0, []
    for ch in inner + ",":
        if ch == "," and depth == 0:
            tok = "".join(cur).split()
            if tok:
                names.append(tok[-1].lstrip("%"))
            cur = []
            continue
        depth += _DEPTH.get(ch, 0)
        cur.append(ch)
    return names, attrs


def _called(attrs: str, key: str) -> list[str]:
    m = re.search(key + r"=(\{[^}]*\}|%?[\w.\-]+)", attrs)
    if not m:
        return []
    return [s.strip().lstrip("%") for s in m.group(1).strip("{}").split(",") if s.strip()]


def classify(ins: Instr, comps: dict[str, list[Instr]]) -> tuple[str, str] | None:
    """(kind, detail) of a top-level instruction, or None when it launches no work."""
    op = ins.op
    if op in _NOT_KERNELS or op.endswith("-done"):
        return None
    if op == "fusion":
        k = re.search(r"kind=k(\w+)", ins.attrs)
        fk = (k.group(1) if k else "loop").lower()
        if fk == "custom":
            bk = re.search(r'"kind"\s*:\s*"([^"]+)"', ins.attrs)
            detail = bk.group(1) if bk else "custom-fusion"
            if not bk:  # e.g. GPU top-k: a kCustom fusion around a sort; name it by its root op
                called = _called(ins.attrs, "calls")
                root = comps.get(called[0], [])[-1:] if called else []
                if root:
                    t = re.search(r'custom_call_target="([^"]+)"', root[0].attrs)
                    detail = f"custom-fusion:{t.group(1) if t else root[0].op}"
            return ("gemm" if _GEMM_TARGETS.search(detail) else "custom"), detail
        return (fk if fk in ("loop", "input", "output") else "other"), f"fusion:{fk}"
    if op in ("dot", "convolution", "ragged-dot"):
        return "gemm", op
    if op == "custom-call":
        t = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
        target = t.group(1) if t else "?"
        if _COLLECTIVE_TARGETS.search(target):  # our FFI collectives (jaxk3_all_reduce, ...)
            return "collective", target
        return ("gemm" if _GEMM_TARGETS.search(target) else "custom"), target
    base = op[:-len("-start")] if op.endswith("-start") else op
    if base in _COLLECTIVES:
        return "collective", base
    if base == "async":  # async-start wrapping a computation: classify what it wraps
        inner = _called(ins.attrs, "calls")
        root = comps.get(inner[0], [])[-1:] if inner else []
        if root:
            got = classify(root[0], comps)
            if got:
                return got
        return "other", "async"
    if base == "copy":
        return "copy", op
    return "other", op


def block_of(op_name: str, blocks: Iterable[str] | None = None) -> str | None:
    """The first named-scope block in an op_name path (`jit(step)/shard_map/layer3_mla/dot_general`
    -> `layer3_mla`), restricted to `blocks` when given; None when it names none."""
    allowed = set(blocks) if blocks is not None else None
    for m in BLOCK_RE.finditer(op_name):
        if allowed is None or m.group(1) in allowed:
            return m.group(1)
    return None


def _block_key(block: str) -> tuple[int, int, str]:
    """Program order of block names: embed, layer0_<attention>, layer0_<ffn>, layer1_..., head."""
    m = re.fullmatch(r"layer(\d+)_(\w+)", block)
    if m:
        return 1, 2 * int(m.group(1)) + (m.group(2) in ("moe", "mlp")), block
    return {"embed": 0, "head": 2}.get(block, 3), 0, block


def _entry_ops(comps: dict[str, list[Instr]], entry: str) -> list[Instr]:
    """The entry computation's instructions with every `call` replaced by its callee's (recursively)."""
    out: list[Instr] = []

    def walk(name: str, depth: int) -> None:
        for ins in comps.get(name, []):
            callee = _called(ins.attrs, "to_apply") if ins.op == "call" else []
            if callee and depth < 8 and callee[0] in comps:
                walk(callee[0], depth + 1)
            else:
                out.append(ins)

    walk(entry, 0)
    return out


def kernel_census(hlo_text: str, blocks: list[str] | None = None) -> dict[str, Any]:
    """The census of one compiled program.

    `hlo_text`: the optimized HLO (`compiled.as_text()`).  `blocks`: the block names in program
    order (e.g. ["embed", "layer0_kda", "layer0_moe", ..., "head"]); None: whatever the op_names
    name (BLOCK_RE), in program order.  Returns a JSON-able dict:
      module (the HLO module name, as profile events name it), blocks (the order; UNSCOPED last
      if any kernel is left in it), kinds (KINDS),
      counts {block: {kind: n}} (every kind, zeros included), totals {block: n},
      total (== sum of totals), by_kind {kind: n}, details {block: {detail: n}} (fusion kinds,
      custom-call targets, collective opcodes), inherited {block: n} (kernels without a block in
      their own op_name), kernel_names {instruction name: block} (the kernels), op_block
      {instruction name: block} for every instruction of the module that can be placed (what
      `profile_times` attributes events with).
    """
    module, comps, entry = parse_hlo(hlo_text)
    ops = _entry_ops(comps, entry)
    known = None if blocks is None else list(blocks)
    own = {i.name: block_of(i.op_name, known) for i in ops}
    users: dict[str, list[str]] = defaultdict(list)
    for i in ops:
        for a in i.operands:
            users[a].append(i.name)
    by_name = {i.name: i for i in ops}

    def inherit(name: str, seen: set[str], forward: bool) -> str | None:
        """The block of the first (transitive) user (forward) or operand (backward) that has one."""
        stack = list(users[name] if forward else by_name[name].operands)
        while stack:
            n = stack.pop(0)
            if n in seen or n not in by_name:
                continue
            seen.add(n)
            if own.get(n):
                return own[n]
            stack.extend(users[n] if forward else by_name[n].operands)
        return None

    kernels: list[Kernel] = []
    for i in ops:
        got = classify(i, comps)
        if got is None:
            continue
        b, inherited = own[i.name], False
        if b is None:  # a GEMM by the block of what it multiplies (XLA's split-K rewrite drops the op_name of the
            # dot it splits, whose first user is the next block's sum of its partials); any other by its user's
            first = got[0] == "gemm"
            b = inherit(i.name, {i.name}, not first) or inherit(i.name, {i.name}, first)
            inherited = b is not None
        kernels.append(Kernel(i.name, got[0], got[1], b or UNSCOPED, inherited))
    order = list(known) if known is not None else []
    extra = sorted({k.block for k in kernels if k.block not in order and k.block != UNSCOPED}, key=_block_key)
    order += extra
    if any(k.block == UNSCOPED for k in kernels):
        order.append(UNSCOPED)
    counts = {b: {kind: 0 for kind in KINDS} for b in order}
    details: dict[str, Counter] = {b: Counter() for b in order}
    inherited_n = Counter()
    for k in kernels:
        counts[k.block][k.kind] += 1
        details[k.block][k.detail] += 1
        inherited_n[k.block] += k.inherited
    op_block = {i.name: own[i.name] for i in ops if own[i.name]}
    op_block.update({k.name: k.block for k in kernels})
    for comp in comps.values():  # nested instructions (loop bodies, ...) by their own op_name
        for i in comp:
            if i.name not in op_block and (b := block_of(i.op_name, known)):
                op_block[i.name] = b
    totals = {b: sum(c.values()) for b, c in counts.items()}
    return {
        "module": module,
        "blocks": order,
        "kinds": list(KINDS),
        "counts": counts,
        "totals": totals,
        "total": len(kernels),
        "by_kind": {kind: sum(c[kind] for c in counts.values()) for kind in KINDS},
        "details": {b: dict(d.most_common()) for b, d in details.items()},
        "inherited": {b: inherited_n[b] for b in order if inherited_n[b]},
        "kernel_names": {k.name: k.block for k in kernels},
        "op_block": op_block,
    }


# ----------------------------------------------------------------------------- profile
class ProfileUnavailable(RuntimeError):
    """No per-block times: the reason (no trace written, no parser, no event of the program)."""


_HLO_OP = re.compile(r"hlo_op=([^,#\s]+)")
_HLO_MODULE = re.compile(r"hlo_module=([^,#\s]+)")


def find_xplane(trace_dir: str) -> str:
    """The newest .xplane.pb under a `jax.profiler.trace` directory."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise ProfileUnavailable(f"the profiler wrote no .xplane.pb under {trace_dir}")
    return files[-1]


def read_profile(xplane_path: str):
    """The trace as jaxlib parses it (`jax.profiler.ProfileData`), or ProfileUnavailable with the reason."""
    try:
        from jax.profiler import ProfileData
    except ImportError as e:
        raise ProfileUnavailable(f"this jaxlib has no jax.profiler.ProfileData ({e})") from e
    try:
        return ProfileData.from_file(xplane_path)
    except Exception as e:  # a truncated or foreign file: the parser's own message
        raise ProfileUnavailable(f"cannot read {xplane_path}: {e}") from e


def _device_planes(planes) -> list:
    """A trace's GPU device planes (not the host's, nor a CPU device's)."""
    return [p for p in planes if p.name.startswith("/device:") and "CPU" not in p.name]


def _stream_lines(plane) -> list:
    """A plane's lines of device events: its streams where it names them, else all of its lines."""
    lines = list(plane.lines)
    return [ln for ln in lines if ln.name.startswith("Stream")] or lines


def _event_op(name: str, stats: dict[str, Any]) -> tuple[str | None, str | None]:
    """(hlo_op, hlo_module) of a trace event: its stats, else `hlo_op=` in a string stat or the name."""
    op, mod = stats.get("hlo_op"), stats.get("hlo_module")
    if op is None:
        for text in [name, *(v for v in stats.values() if isinstance(v, str))]:
            if "hlo_op=" in text:
                m = _HLO_OP.search(text)
                op = m.group(1) if m else None
                mm = _HLO_MODULE.search(text)
                mod = mod or (mm.group(1) if mm else None)
                break
    return (str(op) if op is not None else None), (str(mod) if mod is not None else None)


def profile_times(xplane_path: str, census: dict[str, Any], steps: int) -> dict[str, Any]:
    """Device time per block of the program `census` describes, from a profile of `steps` runs.

    Returns {"us": {block: µs per step per device}, "ops": {block: [[op, µs per step per device], ...]
    slowest first}, "events": {block: events per step per device},
    "devices": n, "source": "device planes" | "host thunks", "unattributed_us": µs per step per
    device of the program's events whose op the census does not place}.  Raises ProfileUnavailable
    with the reason when jaxlib has no parser or no event of the program is in the trace.
    """
    data = read_profile(xplane_path)
    module, op_block = census["module"], census["op_block"]
    planes = list(data.planes)
    device_planes = _device_planes(planes)
    use = device_planes or [p for p in planes if p.name.startswith("/host:")]
    source = "device planes" if device_planes else "host thunks"
    ns: dict[str, float] = defaultdict(float)
    n_ev: Counter = Counter()
    devices: set[str] = set()
    unplaced: Counter = Counter()
    op_ns: Counter = Counter()  # per op: its kernels' time (the block's slowest ops, for "what stands in the way")
    for plane in use:
        for line in _stream_lines(plane):
            open_end = -1.0
            for ev in sorted(line.events, key=lambda e: e.start_ns):
                with warnings.catch_warnings():  # jaxlib 0.12 on Python 3.12: "event_stats has no __module__"
                    warnings.simplefilter("ignore", DeprecationWarning)
                    stats = dict(ev.stats)
                op, mod = _event_op(ev.name, stats)
                if op is None or (mod is not None and module and mod != module):
                    continue
                if mod is None and op not in op_block:
                    continue  # an op of another program cannot be told apart: skip what we cannot place
                end = ev.start_ns + ev.duration_ns
                if ev.start_ns < open_end and end <= open_end:
                    continue  # nested inside a counted event
                open_end = max(open_end, end)
                b = op_block.get(op, UNATTRIBUTED)
                ns[b] += ev.duration_ns
                n_ev[b] += 1
                op_ns[(b, op)] += ev.duration_ns
                if b == UNATTRIBUTED:
                    unplaced[op] += ev.duration_ns
                devices.add(f"{plane.name}#{stats.get('device_ordinal', '')}")
    if not n_ev:
        raise ProfileUnavailable(f"no event of module {module!r} with an hlo_op in the trace "
                                 f"(planes: {', '.join(p.name for p in planes) or 'none'})")
    per = max(1, steps) * max(1, len(devices))
    us = {b: ns[b] / per / 1e3 for b in ns if b != UNATTRIBUTED}
    ops: dict[str, list] = defaultdict(list)
    for (b, op), t in op_ns.most_common():
        if b != UNATTRIBUTED:  # (those are "unattributed_ops")
            ops[b].append([op, round(t / per / 1e3, 2)])
    return {"us": us, "ops": dict(ops), "events": {b: n_ev[b] / per for b in n_ev if b != UNATTRIBUTED}, "devices": len(devices),
            "source": source, "unattributed_us": ns.get(UNATTRIBUTED, 0.0) / per / 1e3,
            "unattributed_events": n_ev.get(UNATTRIBUTED, 0) / per,
            "unattributed_ops": [op for op, _ in unplaced.most_common(5)],
            "total_us": sum(ns.values()) / per / 1e3}


# ----------------------------------------------------------------------------- timeline
GAP_BINS_US = (2.0, 10.0)  # idle gaps by length: under 2 us (a dependent launch's latency), 2-10 us, over 10 us


def busy_idle(intervals: Iterable[tuple[int, int]], steps: int) -> dict[str, Any]:
    """The busy and idle time of one device over `steps` runs from its events' [start, end) intervals (ns; they may
    overlap: a programmatic dependent launch starts before its predecessor ends): the span from the first start to
    the last end, the busy time (the intervals' union), the idle gaps between the union's pieces by length
    (GAP_BINS_US), each per step, and the five longest gaps.  Raises ProfileUnavailable with no interval."""
    iv = sorted((int(a), int(b)) for a, b in intervals)
    if not iv:
        raise ProfileUnavailable("no device event in the trace")
    pieces: list[list[int]] = [list(iv[0])]
    for a, b in iv[1:]:
        if a <= pieces[-1][1]:
            pieces[-1][1] = max(pieces[-1][1], b)
        else:
            pieces.append([a, b])
    busy = sum(b - a for a, b in pieces)
    span = pieces[-1][1] - pieces[0][0]
    gaps = [(pieces[i + 1][0] - pieces[i][1]) / 1e3 for i in range(len(pieces) - 1)]  # us
    per = max(1, steps)
    edges = (0.0, *GAP_BINS_US, float("inf"))
    bins = {}
    for lo, hi in zip(edges, edges[1:]):
        inside = [g for g in gaps if lo <= g < hi]
        label = f"<{hi:g}us" if lo == 0 else (f">={lo:g}us" if hi == float("inf") else f"{lo:g}-{hi:g}us")
        bins[label] = {"gaps": len(inside) / per, "us": sum(inside) / per}
    return {"steps": per, "events": len(iv) / per, "span_us": span / per / 1e3, "busy_us": busy / per / 1e3,
            "idle_us": (span - busy) / per / 1e3, "busy_fraction": busy / span if span else 1.0,
            "gaps": bins, "longest_gaps_us": [round(g, 2) for g in sorted(gaps, reverse=True)[:5]]}


def device_timeline(xplane_path: str, steps: int) -> dict[str, Any]:
    """How busy each GPU was over a profile of `steps` back-to-back runs (`busy_idle` of every event on its stream
    lines: kernels, copies and those replayed inside CUDA graphs alike, whichever program they belong to), and the
    mean over the devices: whether a step's time is the kernels' own (busy) or the GPU waiting between them (idle:
    launch latency, host pacing).  Raises ProfileUnavailable with the reason where the trace has no GPU plane (the
    CPU runs thunks, not device kernels)."""
    data = read_profile(xplane_path)
    planes = _device_planes(data.planes)
    if not planes:
        raise ProfileUnavailable(f"no GPU plane in the trace (planes: {', '.join(p.name for p in data.planes)})")
    per = []
    for plane in planes:
        iv = [(ev.start_ns, ev.start_ns + ev.duration_ns) for ln in _stream_lines(plane) for ev in ln.events]
        if iv:
            per.append(dict(busy_idle(iv, steps), device=plane.name))
    if not per:
        raise ProfileUnavailable("no event on any GPU plane's streams")
    keys = ("events", "span_us", "busy_us", "idle_us", "busy_fraction")
    mean = {k: sum(d[k] for d in per) / len(per) for k in keys}
    labels = list(per[0]["gaps"])
    mean["gaps"] = {b: {k: sum(d["gaps"][b][k] for d in per) / len(per) for k in ("gaps", "us")} for b in labels}
    return dict(mean, steps=per[0]["steps"], devices=per)


def timeline_line(t: dict[str, Any] | None, unavailable: str | None = None) -> str:
    """One line of `device_timeline`'s means (or why there is none)."""
    if not t:
        return f"GPU timeline unavailable: {unavailable}"
    gaps = "; ".join(f"{b} {v['gaps']:.1f} gaps, {v['us']:.1f} us" for b, v in t["gaps"].items())
    longest = t["devices"][0]["longest_gaps_us"] if t.get("devices") else []
    cb = f", command buffers {t['command_buffers']}" if t.get("command_buffers") else ""
    return (f"GPU timeline ({t['steps']} steps back to back{cb}, mean of {len(t.get('devices', [])) or 1} "
            f"device(s)): "
            f"{t['span_us']:.1f} us a step from its first event to its last, the GPU busy {t['busy_us']:.1f} us "
            f"({100 * t['busy_fraction']:.1f}%: the union of {t['events']:.0f} events a step), idle {t['idle_us']:.1f} "
            f"us between them ({gaps}); longest gaps {longest} us")


# ------------------------------------------------------------------------------- table
def layer_summary(census: dict[str, Any]) -> dict[str, Any]:
    """Kernels per layer: {"layers": {g: n (attention + ffn)}, "by_kind": {"kda+moe": mean n}}."""
    per: dict[int, int] = defaultdict(int)
    kinds: dict[int, list[str]] = defaultdict(list)
    for b, n in census["totals"].items():
        m = re.fullmatch(r"layer(\d+)_(\w+)", b)
        if m:
            per[int(m.group(1))] += n
            kinds[int(m.group(1))].append(m.group(2))
    groups: dict[str, list[int]] = defaultdict(list)
    for g, n in per.items():
        groups["+".join(kinds[g])].append(n)
    return {"layers": dict(per), "by_kind": {k: sum(v) / len(v) for k, v in groups.items()}}


def census_table(census: dict[str, Any], times: dict[str, Any] | None, title: str,
                 unavailable: str | None = None, nbytes: dict[str, int] | None = None,
                 bandwidth_GBps: float | None = None) -> str:
    """The census as text: one row per block (kernel counts by kind, total, µs and events per step
    from the profile when `times` is given; with `nbytes` per block and the copy bandwidth, its MB, the µs
    those bytes take at that bandwidth and the block's time over it), a total row and a summary line."""
    floors = bool(times and nbytes and bandwidth_GBps)
    head = f"{'block':<14} | " + " | ".join(f"{k:>6}" for k in census["kinds"]) + f" | {'total':>5}"
    if times:
        head += f" | {'us/step':>8} | {'events':>6}"
    if floors:
        head += f" | {'MB':>7} | {'floor us':>8} | {'x':>5}"

    def floor_cols(us: float, b: int) -> str:
        f = b / (bandwidth_GBps * 1e3)  # bytes / (GB/s) in us
        return f" | {b / 1e6:>7.1f} | {f:>8.1f} | " + (f"{us / f:>5.2f}" if f > 0 else f"{'-':>5}")
    lines = [title, head, "-" * len(head)]
    for b in census["blocks"]:
        c = census["counts"][b]
        row = f"{b:<14} | " + " | ".join(f"{c[k]:>6}" for k in census["kinds"]) + f" | {census['totals'][b]:>5}"
        if times:
            row += f" | {times['us'].get(b, 0.0):>8.1f} | {times['events'].get(b, 0.0):>6.1f}"
        if floors:
            row += floor_cols(times["us"].get(b, 0.0), nbytes.get(b, 0))
        lines.append(row)
    lines.append("-" * len(head))
    row = f"{'total':<14} | " + " | ".join(f"{census['by_kind'][k]:>6}" for k in census["kinds"]) + \
        f" | {census['total']:>5}"
    if times:
        row += f" | {times['total_us']:>8.1f} | {sum(times['events'].values()):>6.1f}"
    if floors:
        row += floor_cols(times["total_us"], sum(nbytes.values()))
    lines.append(row)
    s = layer_summary(census)
    n_layers = len(s["layers"])
    per = ", ".join(f"{k} {v:.1f}" for k, v in s["by_kind"].items())
    lines.append(f"kernels per step: {census['total']}; per layer ({n_layers} layers): "
                 f"{sum(s['layers'].values()) / max(1, n_layers):.1f} on average ({per})")
    targets = Counter()
    for d in census["details"].values():
        targets.update({k: v for k, v in d.items() if not k.startswith("fusion:")})
    if targets:
        lines.append("non-fusion kernels: " + ", ".join(f"{k} x{v}" for k, v in targets.most_common()))
    if census["inherited"]:
        lines.append(f"{sum(census['inherited'].values())} kernels have no block in their op_name and are counted "
                     "in the block of their first user (else operand) that has one")
    if times:
        lines.append(f"us/step, events: sum of event durations per step per device ({times['devices']} devices, "
                     f"{times['source']})")
        if any(op.startswith("command_buffer") for op in times["unattributed_ops"]):
            lines.append("the kernels ran inside CUDA graphs (XLA command buffers), whose events carry the graph's "
                         "name: for per-block times run with XLA_FLAGS=--xla_gpu_enable_command_buffer=")
        if times["unattributed_events"]:
            lines.append(f"unplaced: {times['unattributed_us']:.1f} us/step in {times['unattributed_events']:.1f} events "
                         f"per step of this program whose hlo_op is not an op of the census (e.g. "
                         f"{', '.join(times['unattributed_ops'])})")
    elif unavailable:
        lines.append(f"profile times unavailable: {unavailable}")
    if floors:
        lines.append(f"MB: the block's weights (the distinct experts a step is expected to touch) and its layer's cache "
                     f"per rank; floor us: those bytes at the copy bandwidth ({bandwidth_GBps:.0f} GB/s); x: us/step "
                     "over it")
    return "\n".join(lines)
