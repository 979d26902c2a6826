"""Transition cost on a GPU: a layer's variant copied host (pinned) -> device on a side stream
while a decode loop runs.

    python -m benchmark.gpu.transition         # on the device machine

The decode loop is a Llama-3-8B-shaped decoder (32 layers of bf16 weights, random values,
GQA 32/8 heads of 128, SDPA over a KV cache of ``--context`` tokens for ``--batch`` sequences),
one CUDA graph per step, replayed back to back on the default stream; each step is timed with
CUDA events. Measured:

1. copy time of one layer per variant (bf16, W8, W4 AWQ) from pinned host memory on an idle
   device, for Llama-3-8B and Llama-2-7B layer shapes (MorphServe reports about 16 ms per FP16
   Llama-2-7B layer and 4 ms INT4 on an L4),
2. the same copies on a side stream while the decode loop runs: decode-step slowdown (median
   step time of steps that ran entirely inside a copy window over the median of steps with no
   copy, in alternating rounds so drift hits both), and the copy's own time under load,
3. a whole transition as the runtime performs it: ``morph_kernels.prepare(...,
   non_blocking=True)`` of a layer's four fused linears from pinned host tensors on a side
   stream (copies plus the W4 layout work), installed once its event completes.
"""

from __future__ import annotations

import argparse
import statistics

import morph_kernels
import torch
import torch.nn.functional as F
from sglang_morph.engines import formats

from benchmark.gpu.common import device_info, table, write_results

LLAMA3_8B = dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, layers=32)
LLAMA2_7B = dict(hidden=4096, intermediate=11008, heads=32, kv_heads=32, head_dim=128, layers=32)
MORPHSERVE_L4_MS = {"bf16": 16.0, "w4_awq": 4.0}  # per FP16 / INT4 Llama-2-7B layer (paper)


def fused_linears(m: dict) -> dict[str, tuple[int, int]]:
    """SGLang's four fused linears of one decoder layer: name -> (in_features, out_features)."""
    h, d = m["hidden"], m["head_dim"]
    return {
        "qkv_proj": (h, (m["heads"] + 2 * m["kv_heads"]) * d),
        "o_proj": (m["heads"] * d, h),
        "gate_up_proj": (h, 2 * m["intermediate"]),
        "down_proj": (m["intermediate"], h),
    }


def host_layer_variant(m: dict, variant: str, gen: torch.Generator) -> dict[str, dict]:
    """One layer's stored tensors per fused linear, in pinned host memory (pre-staged)."""
    out = {}
    for name, (k, n) in fused_linears(m).items():
        weight = torch.randn(n, k, generator=gen, device="cuda") * 0.02
        if variant == "bf16":
            stored = {"weight": weight.to(torch.bfloat16)}
        elif variant == "w8":
            stored = formats.get_format(8).quantize(weight)
        else:
            scale = torch.rand(k, generator=gen, device="cuda") * 1.5 + 0.5
            stored = formats.get_format(4).quantize(weight, group_size=128, input_scale=scale)
        out[name] = {t: v.cpu().pin_memory() for t, v in stored.items()}
    return out


def nbytes(layer: dict[str, dict]) -> int:
    return sum(formats.device_bytes(tensors) for tensors in layer.values())


class DecodeLoop:
    """A Llama-shaped decode step captured in one CUDA graph (random bf16 weights)."""

    def __init__(self, m: dict, batch: int, context: int, gen: torch.Generator):
        h, d, hq, hkv = m["hidden"], m["head_dim"], m["heads"], m["kv_heads"]
        self.m, self.batch = m, batch

        def w(n, k):
            return (torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)

        shapes = fused_linears(m)
        self.layers = [{name: w(n, k) for name, (k, n) in shapes.items()}
                       for _ in range(m["layers"])]
        self.k_cache = [torch.randn(batch, hkv, context, d, generator=gen, device="cuda")
                        .to(torch.bfloat16) for _ in range(m["layers"])]
        self.v_cache = [torch.randn_like(k) for k in self.k_cache]
        self.x = torch.randn(batch, h, generator=gen, device="cuda").to(torch.bfloat16)
        self.pos = torch.tensor([context - 1], device="cuda")
        self.weight_bytes = sum(t.numel() * 2 for layer in self.layers for t in layer.values())
        self.step()  # eager once (cuBLAS handles, SDPA kernels) before capture
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.step()
        torch.cuda.synchronize()

    def step(self) -> torch.Tensor:
        m, b = self.m, self.batch
        hq, hkv, d = m["heads"], m["kv_heads"], m["head_dim"]
        x = self.x
        for layer, kc, vc in zip(self.layers, self.k_cache, self.v_cache):
            h = F.rms_norm(x, (x.shape[-1],))
            qkv = F.linear(h, layer["qkv_proj"])
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            kc.index_copy_(2, self.pos, k.view(b, hkv, 1, d))
            vc.index_copy_(2, self.pos, v.view(b, hkv, 1, d))
            attn = F.scaled_dot_product_attention(q.view(b, hq, 1, d), kc, vc, enable_gqa=True)
            x = x + F.linear(attn.reshape(b, hq * d), layer["o_proj"])
            h = F.rms_norm(x, (x.shape[-1],))
            gate, up = F.linear(h, layer["gate_up_proj"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["down_proj"])
        return x

    def run(self, steps: int) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
        events = []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.graph.replay()
            end.record()
            events.append((start, end))
        return events


# Paced copies: chunks of this size with the side stream idling between them, so the copy
# engine takes a fraction of the time (and of the HBM write traffic) it would at full speed.
PACE_CHUNK_BYTES = 8 << 20
_sleep_cycles_per_ms: list[float] = []


def sleep_cycles_per_ms() -> float:
    """GPU clock cycles per ms of ``torch.cuda._sleep`` (a spin kernel), measured once."""
    if not _sleep_cycles_per_ms:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        _sleep_cycles_per_ms.append(20_000_000 / start.elapsed_time(end))
    return _sleep_cycles_per_ms[0]


def copy_layer(layer: dict[str, dict], stream: torch.cuda.Stream,
               gap_per_chunk_ms: float = 0.0) -> list[torch.Tensor]:
    """Queue the layer's host -> device copies on ``stream``; with a gap, in paced chunks."""
    with torch.cuda.stream(stream):
        if gap_per_chunk_ms <= 0:
            return [t.to("cuda", non_blocking=True) for tensors in layer.values()
                    for t in tensors.values()]
        gap_cycles = int(gap_per_chunk_ms * sleep_cycles_per_ms())
        out = []
        for tensors in layer.values():
            for t in tensors.values():
                dst = torch.empty(t.shape, dtype=t.dtype, device="cuda")
                src_bytes, dst_bytes = t.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
                for off in range(0, src_bytes.numel(), PACE_CHUNK_BYTES):
                    dst_bytes[off:off + PACE_CHUNK_BYTES].copy_(
                        src_bytes[off:off + PACE_CHUNK_BYTES], non_blocking=True)
                    torch.cuda._sleep(gap_cycles)
                out.append(dst)
        return out


def timed_on(stream: torch.cuda.Stream, fn) -> tuple[torch.cuda.Event, torch.cuda.Event, object]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    out = fn()
    end.record(stream)
    return start, end, out


def idle_copy_ms(layer: dict[str, dict], repeats: int = 7, gap_ms: float = 0.0) -> float:
    side = torch.cuda.Stream()
    times = []
    for _ in range(repeats):
        start, end, _ = timed_on(side, lambda: copy_layer(layer, side, gap_ms))
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def slowdown_under_copies(loop: DecodeLoop, layer: dict[str, dict], rounds: int,
                          steps: int, gap_ms: float = 0.0) -> dict:
    """Alternating rounds: ``steps`` decode steps alone, then ``steps`` steps with back-to-back
    copies of ``layer`` on a side stream (paced by ``gap_ms`` per chunk). Returns median step
    times and the copy time under load."""
    side = torch.cuda.Stream()
    base, loaded, copy_ms = [], [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        events = loop.run(steps)
        torch.cuda.synchronize()
        base += [s.elapsed_time(e) for s, e in events]
        # Enough copies to outlast the decode steps (the median step time so far).
        copy_alone_ms = idle_copy_ms(layer, repeats=1, gap_ms=gap_ms)
        n_copies = int(steps * statistics.median(base) / max(copy_alone_ms, 1e-3)) + 2
        origin = torch.cuda.Event(enable_timing=True)
        origin.record()
        side.wait_stream(torch.cuda.current_stream())
        windows = []
        for _ in range(n_copies):
            start, end, _ = timed_on(side, lambda: copy_layer(layer, side, gap_ms))
            windows.append((start, end))
        events = loop.run(steps)
        torch.cuda.synchronize()
        first, last = origin.elapsed_time(windows[0][0]), origin.elapsed_time(windows[-1][1])
        for s, e in events:
            if origin.elapsed_time(s) >= first and origin.elapsed_time(e) <= last:
                loaded.append(s.elapsed_time(e))
        copy_ms += [s.elapsed_time(e) for s, e in windows]
    base_ms, loaded_ms = statistics.median(base), statistics.median(loaded)
    return {"step_ms_alone": base_ms, "step_ms_during_copy": loaded_ms,
            "steps_during_copy": len(loaded), "slowdown": loaded_ms / base_ms - 1.0,
            "copy_ms_under_decode": statistics.median(copy_ms)}


def one_transition(loop: DecodeLoop, layer: dict[str, dict], repeats: int,
                   gap_ms: float = 0.0) -> dict:
    """One layer copied once while decoding: the decode time the steps overlapping the copy
    lost, in ms and as a share of one step (median over ``repeats``)."""
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    warm = loop.run(50)
    torch.cuda.synchronize()
    base = statistics.median(s.elapsed_time(e) for s, e in warm)
    extra = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        origin = torch.cuda.Event(enable_timing=True)
        origin.record()
        events = loop.run(3)
        side.wait_stream(torch.cuda.current_stream())
        start, end, _ = timed_on(side, lambda: copy_layer(layer, side, gap_ms))
        events += loop.run(12)
        torch.cuda.synchronize()
        c0, c1 = origin.elapsed_time(start), origin.elapsed_time(end)
        overlap = [s.elapsed_time(e) for s, e in events
                   if origin.elapsed_time(e) > c0 and origin.elapsed_time(s) < c1]
        extra.append(sum(overlap) - len(overlap) * base)
    extra_ms = statistics.median(extra)
    return {"step_ms": base, "extra_ms": extra_ms, "extra_share_of_step": extra_ms / base}


def prepare_on_side_stream(loop: DecodeLoop, layer: dict[str, dict], bits: int) -> dict:
    """The runtime's transition: prepare a layer's four linears on a side stream while decode
    steps run, install when its event completes. Returns the side stream's time for it (and,
    as ``decode_steps_meanwhile``, how many graph replays the host queued while polling the
    event: launches, not executed steps, so the Markdown leaves it out)."""
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    done = torch.cuda.Event()
    events = loop.run(4)  # the serving stream is busy when the transition starts
    with torch.cuda.stream(side):
        start = torch.cuda.Event(enable_timing=True)
        start.record(side)
        prepared = {name: morph_kernels.prepare(bits, tensors, device="cuda",
                                                act_dtype=torch.bfloat16, non_blocking=True)
                    for name, tensors in layer.items()}
        end = torch.cuda.Event(enable_timing=True)
        end.record(side)
        done.record(side)
    steps_meanwhile = 0
    while not done.query():  # the scheduler keeps stepping until the variant is on the device
        events += loop.run(1)
        steps_meanwhile += 1
    torch.cuda.current_stream().wait_event(done)  # what install does before the next forward
    torch.cuda.synchronize()
    return {"prepare_ms": start.elapsed_time(end), "decode_steps_meanwhile": steps_meanwhile,
            "device_bytes": sum(p.device_bytes for p in prepared.values())}


def run(args) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {"device": device_info(), "batch": args.batch, "context": args.context,
           "copies": [], "slowdown": [], "prepare": []}
    for model_name, m in (("llama-2-7b", LLAMA2_7B), ("llama-3-8b", LLAMA3_8B)):
        for variant in ("bf16", "w8", "w4_awq"):
            layer = host_layer_variant(m, variant, gen)
            ms = idle_copy_ms(layer)
            out["copies"].append({"model": model_name, "variant": variant, "bytes": nbytes(layer),
                                  "idle_copy_ms": ms,
                                  "h2d_bytes_per_s": nbytes(layer) / (ms * 1e-3)})
            print(out["copies"][-1], flush=True)
    loop = DecodeLoop(LLAMA3_8B, args.batch, args.context, gen)
    out["decode_weight_bytes"] = loop.weight_bytes
    chunk_ms = PACE_CHUNK_BYTES / out["copies"][-1]["h2d_bytes_per_s"] * 1e3
    for variant in ("bf16", "w4_awq"):
        layer = host_layer_variant(LLAMA3_8B, variant, gen)
        for pace in (1, 2, 4):  # copy at 1/pace of full speed
            gap_ms = (pace - 1) * chunk_ms
            result = {"variant": variant, "bytes": nbytes(layer), "pace": pace,
                      **slowdown_under_copies(loop, layer, args.rounds, args.steps, gap_ms),
                      "one_transition": one_transition(loop, layer, 7, gap_ms)}
            out["slowdown"].append(result)
            print(result, flush=True)
    for variant, bits in (("w8", 8), ("w4_awq", 4)):
        layer = host_layer_variant(LLAMA3_8B, variant, gen)
        prepare_on_side_stream(loop, layer, bits)  # first time: caches, allocator
        result = {"variant": variant, **prepare_on_side_stream(loop, layer, bits)}
        out["prepare"].append(result)
        print(result, flush=True)
    return out


def markdown(r: dict) -> str:
    d = r["device"]
    lines = [f"# Transition cost on {d['gpu']}\n\n",
             f"torch {d['torch']} (CUDA {d['cuda']}), commit {d['commit']}. Host tensors in pinned "
             f"memory (pre-staged), random values at real shapes.\n\n",
             "## One layer, host (pinned) -> device, idle device\n\n",
             table(["model", "variant", "MB", "copy ms", "GB/s", "MorphServe L4 ms"],
                   [[c["model"], c["variant"], f"{c['bytes'] / 1e6:.1f}",
                     f"{c['idle_copy_ms']:.2f}", f"{c['h2d_bytes_per_s'] / 1e9:.1f}",
                     MORPHSERVE_L4_MS.get(c["variant"], "") if c["model"] == "llama-2-7b" else ""]
                    for c in r["copies"]]),
             f"\n## Decode-step slowdown while a layer is copied on a side stream\n\n"
             f"Llama-3-8B-shaped decode step (32 bf16 layers, {r['decode_weight_bytes'] / 1e9:.1f} "
             f"GB of weights), batch {r['batch']}, context {r['context']}, one CUDA graph per "
             f"step; median step time of steps entirely inside a copy window vs steps with no "
             f"copy, in alternating rounds.\n\n",
             "Pace 1 copies at full speed; pace n in 8 MiB chunks with the side stream idle "
             "between chunks for (n - 1) chunk times (`torch.cuda._sleep`), i.e. at 1/n of "
             "the speed. \"One transition\": a single copy of the layer while decoding, the "
             "decode time lost by the steps it overlapped (median of 7), as a share of one "
             "step.\n\n",
             table(["copied variant", "MB", "pace", "step ms alone", "step ms during copies",
                    "steps", "slowdown while copying", "copy ms under decode",
                    "one transition: lost ms", "of one step"],
                   [[s["variant"], f"{s['bytes'] / 1e6:.1f}", f"1/{s['pace']}",
                     f"{s['step_ms_alone']:.3f}", f"{s['step_ms_during_copy']:.3f}",
                     s["steps_during_copy"], f"{100 * s['slowdown']:+.2f}%",
                     f"{s['copy_ms_under_decode']:.2f}",
                     f"{s['one_transition']['extra_ms']:.3f}",
                     f"{100 * s['one_transition']['extra_share_of_step']:.2f}%"]
                    for s in r["slowdown"]]),
             "\n## A whole transition: `morph_kernels.prepare(non_blocking=True)` of a layer's "
             "four fused linears on a side stream\n\n",
             table(["variant", "device MB", "prepare ms (side stream, under decode)"],
                   [[p["variant"], f"{p['device_bytes'] / 1e6:.1f}", f"{p['prepare_ms']:.2f}"]
                    for p in r["prepare"]])]
    return "".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    result = run(args)
    write_results("transition", result, markdown(result))


if __name__ == "__main__":
    main()
