"""Tests for the weight-only quantized linear kernels (sgl-kernel/morph-kernels, ``morph_kernels``).

Every kernel is compared with the format's own reference, ``formats.dequantize(stored)`` then
``F.linear`` in fp32, under an elementwise error bound built from the roundings a kernel may
do (``error_bound``). The Triton kernels also run here, on CPU tensors, under Triton's
interpreter: in a subprocess (this file run as a script), because ``TRITON_INTERPRET`` must be
set before Triton is imported. The real-GPU tests (Llama-3-8B shapes, warmup, CUDA graphs) run
only where CUDA is available, i.e. on the device machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from sglang_morph.engines import formats

import morph_kernels

CPU_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
W4_IN_FEATURES = 256  # divisible by every W4 group size
# Not a multiple of any GPU BLOCK_K: the W8 GPU kernel's partial last K step.
W8_IN_FEATURES = 200
# Not a multiple of 16 (the CPU int4 op's output padding) nor of any GPU BLOCK_N (masks).
OUT_FEATURES = 40
LEAD_SHAPES = ((1,), (8,), (33,), (3, 11))  # 1, 8 and 33 tokens, and 33 as a 3-D x

# Rounding steps of the worst path (CPU W4 with input_scale and bias), each at most one unit
# roundoff u of the activation dtype relative to the x_k * w_k term (or output) it touches:
#   x * input_scale_inv rounds the reciprocal and the product (2);
#   a kernel may round the dequantized weight to the activation dtype before its dot (1);
#   the output is rounded to the activation dtype (1), and again after the bias add (1).
ROUNDINGS_PER_TERM = 5
# torch's int4 convention is w = (q - 8) * s + zero: the CPU W4 kernel holds (8 - z) * s.
TORCH_INT4_MIDPOINT = 8


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def make_stored(
    bits: int,
    out_features: int,
    in_features: int,
    *,
    group_size: int | None = None,
    input_scale: bool = False,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen, device=device)
    if bits == 8:
        return formats.get_format(8).quantize(weight)
    scale = None
    if input_scale:  # AWQ-like per-input-channel scales in [0.5, 2)
        scale = torch.rand(in_features, generator=gen, device=device) * 1.5 + 0.5
    return formats.get_format(4).quantize(weight, group_size=group_size, input_scale=scale)


def reference(x: torch.Tensor, stored: dict, bits: int, bias: torch.Tensor | None) -> torch.Tensor:
    w_eff = formats.get_format(bits).dequantize(stored)
    return F.linear(x.float(), w_eff, None if bias is None else bias.float())


def error_bound(
    x: torch.Tensor, stored: dict, bits: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """Elementwise bound on ``|linear(x) - reference(x)|``.

    ``ROUNDINGS_PER_TERM * u`` relative to ``sum_k |x_k w_k| + |bias|`` for the roundings
    listed above, plus ``K * u_fp32`` for each of the two fp32 accumulations (kernel and
    reference). For W4 the CPU kernel also holds ``zero = (8 - z) * s`` rounded to the
    activation dtype: an error of ``u * |8 - z| * s`` per weight that is not relative to the
    weight (a weight near 0 can have a large zero term), so it gets its own term.
    """
    u = unit_roundoff(x.dtype)
    in_features = x.shape[-1]
    ax = x.float().abs()
    magnitude = ax @ formats.get_format(bits).dequantize(stored).abs().T
    if bias is not None:
        magnitude = magnitude + bias.float().abs()
    bound = (ROUNDINGS_PER_TERM * u + 2 * in_features * unit_roundoff(torch.float32)) * magnitude
    if bits == 4:
        zeros, scales = stored["zeros"].float(), stored["scales"].float()
        group_size = formats.w4_group_size_of(stored)
        zero_terms = ((TORCH_INT4_MIDPOINT - zeros).abs() * scales).repeat_interleave(group_size, 1)
        if "input_scale" in stored:
            zero_terms = zero_terms / stored["input_scale"].float()
        bound = bound + u * (ax @ zero_terms.T)
    return bound


def assert_within_bound(y, x, stored, bits, bias) -> float:
    """Asserts the bound; returns the largest error/bound ratio (for the record)."""
    ref = reference(x, stored, bits, bias)
    bound = error_bound(x, stored, bits, bias)
    err = (y.float() - ref).abs()
    ratio = (err / bound).max().item()
    assert ratio <= 1.0, f"error exceeds the bound by {ratio:.2f}x (max err {err.max().item():.3g})"
    return ratio


def random_bias(out_features: int, dtype: torch.dtype, with_bias: bool) -> torch.Tensor | None:
    if not with_bias:
        return None
    return torch.randn(out_features, generator=torch.Generator().manual_seed(7)).to(dtype)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """The matrix tests' tensors are tiny: with torch's default pool every op pays a thread
    handoff (measured ~20 ms per op on this busy 2-core machine, vs ~0.01 ms on one thread).
    ``test_cpu_kernels_at_default_thread_count`` covers the threaded kernels."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- CPU kernels ---------------------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("lead_shape", LEAD_SHAPES, ids=str)
@pytest.mark.parametrize("act_dtype", CPU_ACT_DTYPES, ids=str)
def test_cpu_w8_matches_reference(one_thread, act_dtype, lead_shape, with_bias):
    stored = make_stored(8, OUT_FEATURES, W8_IN_FEATURES)
    w = morph_kernels.prepare(8, stored, device="cpu", act_dtype=act_dtype)
    x = torch.randn(*lead_shape, W8_IN_FEATURES).to(act_dtype)
    bias = random_bias(OUT_FEATURES, act_dtype, with_bias)
    y = morph_kernels.linear(x, w, bias)
    assert y.shape == (*lead_shape, OUT_FEATURES) and y.dtype == act_dtype
    assert_within_bound(y, x, stored, 8, bias)


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("lead_shape", LEAD_SHAPES, ids=str)
@pytest.mark.parametrize("act_dtype", CPU_ACT_DTYPES, ids=str)
@pytest.mark.parametrize("input_scale", [False, True], ids=["plain", "input_scale"])
@pytest.mark.parametrize("group_size", formats.W4_GROUP_SIZES)
def test_cpu_w4_matches_reference(
    one_thread, group_size, input_scale, act_dtype, lead_shape, with_bias
):
    stored = make_stored(
        4, OUT_FEATURES, W4_IN_FEATURES, group_size=group_size, input_scale=input_scale
    )
    w = morph_kernels.prepare(4, stored, device="cpu", act_dtype=act_dtype)
    assert w.group_size == group_size
    x = torch.randn(*lead_shape, W4_IN_FEATURES).to(act_dtype)
    bias = random_bias(OUT_FEATURES, act_dtype, with_bias)
    y = morph_kernels.linear(x, w, bias)
    assert y.shape == (*lead_shape, OUT_FEATURES) and y.dtype == act_dtype
    assert y.is_contiguous()
    assert_within_bound(y, x, stored, 4, bias)


@pytest.mark.parametrize(
    "bits,group_size,out_features,in_features",
    [(8, None, 64, 256), (8, None, OUT_FEATURES, W8_IN_FEATURES)]
    + [(4, g, 64, 256) for g in formats.W4_GROUP_SIZES]
    + [(4, 128, OUT_FEATURES, 256)],
)
def test_cpu_kernels_at_default_thread_count(bits, group_size, out_features, in_features):
    # 64 x 256 needs neither the int4 op's output padding nor the int8 op's input padding.
    stored = make_stored(
        bits, out_features, in_features, group_size=group_size, input_scale=bits == 4
    )
    w = morph_kernels.prepare(bits, stored, device="cpu", act_dtype=torch.bfloat16)
    qweight = w.tensors["qweight" if bits == 8 else "qweight_int4pack"]
    padded = (out_features, in_features) != (64, 256)
    assert (qweight.shape != stored["qweight"].shape) == padded
    x = torch.randn(33, in_features).to(torch.bfloat16)
    assert_within_bound(morph_kernels.linear(x, w), x, stored, bits, None)


@pytest.mark.parametrize("bits", [8, 4])
def test_cpu_float32_keeps_the_weight_quantized(bits):
    # fp32 activations dequantize per call (morph_kernels.cpu): what stays resident must be
    # the quantized weight, or a swap to W8/W4 would free no memory.
    stored = make_stored(bits, OUT_FEATURES, W4_IN_FEATURES, group_size=128,
                         input_scale=bits == 4)
    w = morph_kernels.prepare(bits, stored, device="cpu", act_dtype=torch.float32)
    name = "qweight" if bits == 8 else "qweight_planar"
    assert w.tensors[name].dtype == stored["qweight"].dtype
    assert w.tensors[name].shape == stored["qweight"].shape
    assert all(t.numel() < OUT_FEATURES * W4_IN_FEATURES // 2 or n == name
               for n, t in w.tensors.items())
    packed = morph_kernels.prepare(bits, stored, device="cpu", act_dtype=torch.bfloat16)
    assert w.device_bytes <= 1.1 * packed.device_bytes  # scales in fp32 instead of bf16
    x = torch.randn(33, W4_IN_FEATURES)
    assert_within_bound(morph_kernels.linear(x, w), x, stored, bits, None)


def test_bound_is_tight_enough_to_catch_an_off_by_one_zero_point():
    # The kernel run on zeros - 1 (every weight shifted by one scale step) must fail the bound
    # of the true weight, or the bound would be too loose to mean anything.
    stored = make_stored(4, OUT_FEATURES, W4_IN_FEATURES, group_size=64)
    shifted = {**stored, "zeros": (stored["zeros"].int() - 1).clamp(0, 15).to(torch.uint8)}
    w = morph_kernels.prepare(4, shifted, device="cpu", act_dtype=torch.bfloat16)
    x = torch.randn(8, W4_IN_FEATURES).to(torch.bfloat16)
    with pytest.raises(AssertionError, match="exceeds the bound"):
        assert_within_bound(morph_kernels.linear(x, w), x, stored, 4, None)


def test_zero_tokens_give_an_empty_output():
    stored = make_stored(4, OUT_FEATURES, W4_IN_FEATURES, group_size=128)
    w = morph_kernels.prepare(4, stored, device="cpu", act_dtype=torch.bfloat16)
    y = morph_kernels.linear(torch.empty(0, W4_IN_FEATURES, dtype=torch.bfloat16), w)
    assert y.shape == (0, OUT_FEATURES)


def test_cpu_warmup_runs():
    for bits, group_size in ((8, None), (4, 32)):
        stored = make_stored(bits, OUT_FEATURES, W4_IN_FEATURES, group_size=group_size)
        w = morph_kernels.prepare(bits, stored, device="cpu", act_dtype=torch.float32)
        morph_kernels.warmup(w)


# ---- PreparedWeight bookkeeping and validation ----------------------------------------------


@pytest.mark.parametrize(
    "bits,group_size,input_scale,act_dtype",
    [
        (8, None, False, torch.bfloat16),
        (8, None, False, torch.float32),
        (4, 128, False, torch.bfloat16),
        (4, 32, True, torch.float32),
    ],
)
def test_device_bytes_is_the_sum_of_the_prepared_tensors(bits, group_size, input_scale, act_dtype):
    stored = make_stored(
        bits, OUT_FEATURES, W4_IN_FEATURES, group_size=group_size, input_scale=input_scale
    )
    w = morph_kernels.prepare(bits, stored, device="cpu", act_dtype=act_dtype)
    assert w.device_bytes == sum(t.numel() * t.element_size() for t in w.tensors.values())
    act_bytes = torch.finfo(act_dtype).bits // 8
    if bits == 8:  # int8 weight + one scale per output channel
        assert w.device_bytes == OUT_FEATURES * W4_IN_FEATURES + OUT_FEATURES * act_bytes
    else:  # half-byte weights and a (scale, zero) pair per group, over 16-padded outputs
        # (torch's packed op; fp32's dequantize path keeps the stored, unpadded rows)
        padded = OUT_FEATURES if act_dtype == torch.float32 else -(-OUT_FEATURES // 16) * 16
        groups = W4_IN_FEATURES // group_size
        expected = padded * W4_IN_FEATURES // 2 + groups * padded * 2 * act_bytes
        expected += W4_IN_FEATURES * act_bytes if input_scale else 0
        assert w.device_bytes == expected


def _w4_stored() -> dict[str, torch.Tensor]:
    return make_stored(4, OUT_FEATURES, W4_IN_FEATURES, group_size=64, input_scale=True)


@pytest.mark.parametrize(
    "bits,mutate,named",
    [
        (8, lambda t: t.update(scales=t["scales"].float()), "'scales'"),
        (8, lambda t: t.update(scales=t["scales"][:-1]), "'scales'"),
        (8, lambda t: t.pop("scales"), "'scales'"),
        (8, lambda t: t.update(qweight=t["qweight"].flatten()), "'qweight'"),
        (8, lambda t: t.pop("qweight"), "'qweight'"),
        (4, lambda t: t.update(zeros=t["zeros"].int()), "'zeros'"),
        (4, lambda t: t.pop("zeros"), "'zeros'"),
        (4, lambda t: t.update(scales=t["scales"][:, :3]), "scales imply a group size"),
        (4, lambda t: t.update(input_scale=t["input_scale"][:-2]), "'input_scale'"),
        (4, lambda t: t.update(qweight=t["qweight"].to(torch.int8)), "'qweight'"),
        (4, lambda t: t.update(extra=torch.zeros(1)), "extra"),
    ],
)
def test_prepare_rejects_inconsistent_stored_tensors(bits, mutate, named):
    stored = dict(make_stored(8, OUT_FEATURES, W8_IN_FEATURES) if bits == 8 else _w4_stored())
    mutate(stored)
    with pytest.raises(ValueError, match=named):
        morph_kernels.prepare(bits, stored, device="cpu", act_dtype=torch.bfloat16)


def test_prepare_rejects_bad_arguments():
    stored = _w4_stored()
    with pytest.raises(ValueError, match="bit-width 3"):
        morph_kernels.prepare(3, stored, device="cpu", act_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="device meta"):
        morph_kernels.prepare(4, stored, device="meta", act_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="torch.int8"):
        morph_kernels.prepare(4, stored, device="cpu", act_dtype=torch.int8)


def test_linear_rejects_mismatched_inputs():
    w = morph_kernels.prepare(4, _w4_stored(), device="cpu", act_dtype=torch.bfloat16)
    x = torch.zeros(2, W4_IN_FEATURES, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="input features"):
        morph_kernels.linear(x[:, :-2], w)
    with pytest.raises(ValueError, match="prepared for torch.bfloat16"):
        morph_kernels.linear(x.float(), w)
    with pytest.raises(ValueError, match="bias must be"):
        morph_kernels.linear(x, w, torch.zeros(OUT_FEATURES + 1, dtype=torch.bfloat16))


# ---- Triton kernels under Triton's interpreter (CPU) ---------------------------------------

# (bits, group_size, input_scale, activation dtype, tokens): every W4 group size, both dtypes,
# a decode tile (1 token) and a masked multi-tile one (33 tokens, with a bias).
INTERPRETER_CASES = [
    (8, None, False, dtype, tokens) for dtype in ("bfloat16", "float16") for tokens in (1, 33)
] + [
    (4, group_size, dtype == "bfloat16", dtype, tokens)
    for group_size in formats.W4_GROUP_SIZES
    for dtype in ("bfloat16", "float16")
    for tokens in (1, 33)
]


def _case_id(case) -> str:
    bits, group_size, input_scale, dtype, tokens = case
    scale = "-input_scale" if input_scale else ""
    return f"w{bits}-g{group_size}{scale}-{dtype}-{tokens}tok"


def _widen_bf16_dot(interpreter) -> None:
    """Triton's interpreter holds bf16 as raw uint16 and its tl.dot multiplies those bit patterns
    (triton-lang/triton#11584: bf16 is unsupported there). bf16 -> fp32 is exact, so widening the
    operands first makes the interpreter compute what the GPU computes."""
    import numpy as np
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = dot


def _one_hot_exact(linear, stored: dict, act_dtype: torch.dtype) -> bool:
    """Row i of ``linear(x)`` for x = e_{c_i} is input column c_i of the weight the kernel
    used: it must equal ``formats.dequantize(stored)`` rounded once to ``act_dtype``, bit for
    bit (a one-hot dot adds only zeros to the one product)."""
    w_eff = formats.get_format(4).dequantize(stored).to(act_dtype)
    in_features = w_eff.shape[1]
    cols = torch.randperm(in_features)[:16]
    x = torch.zeros(16, in_features, dtype=act_dtype, device=w_eff.device)
    x[torch.arange(16), cols] = 1.0
    return bool(torch.equal(linear(x), w_eff[:, cols].t()))


def _interpreter_main() -> None:
    """Child process: each case with every candidate configuration; one JSON line per case.

    First it reports whether the imports at the top of this file (morph_kernels included)
    imported Triton: the package must import it only for the GPU path.
    """
    print(json.dumps({"triton_imported_by_package": "triton" in sys.modules}), flush=True)
    torch.set_num_threads(1)  # tiny tensors: see the one_thread fixture
    torch.manual_seed(0)
    try:
        from triton.runtime import interpreter
    except ImportError as exc:
        print(json.dumps({"skip": f"Triton is not importable here: {exc}"}))
        return
    if not hasattr(interpreter, "InterpreterBuilder"):
        print(json.dumps({"skip": "this Triton's interpreter has no InterpreterBuilder to patch"}))
        return
    _widen_bf16_dot(interpreter)
    from morph_kernels import triton_gpu

    for case in INTERPRETER_CASES:
        bits, group_size, input_scale, dtype_name, tokens = case
        act_dtype = getattr(torch, dtype_name)
        in_features = W8_IN_FEATURES if bits == 8 else W4_IN_FEATURES
        result = {"case": _case_id(case)}
        try:
            stored = make_stored(
                bits, OUT_FEATURES, in_features, group_size=group_size, input_scale=input_scale
            )
            tensors = triton_gpu.prepare_tensors(bits, stored, act_dtype)
            w = morph_kernels.PreparedWeight(
                bits, OUT_FEATURES, in_features, group_size, tensors, act_dtype
            )
            x = torch.randn(tokens, in_features).to(act_dtype)
            bias = random_bias(OUT_FEATURES, act_dtype, tokens > 1)
            configs = triton_gpu.candidate_configs(triton_gpu.m_bucket(tokens), group_size)
            result["max_ratio"] = max(
                assert_within_bound(triton_gpu.linear(x, w, bias, config), x, stored, bits, bias)
                for config in configs
            )
            result["configs"] = len(configs)
            if bits == 4:
                result["dequant_ratio"] = assert_within_bound(
                    triton_gpu.linear(x, w, bias, backend="dequant_cublas"), x, stored, bits, bias)
                if not input_scale:
                    result["one_hot_exact"] = [
                        _one_hot_exact(lambda v, c=config: triton_gpu.linear(v, w, None, c),
                                       stored, act_dtype)
                        for config in configs
                    ] + [_one_hot_exact(
                        lambda v: triton_gpu.linear(v, w, None, backend="dequant_cublas"),
                        stored, act_dtype)]
            # Same bytes as stored: the GPU layout only transposes W4 scales/zeros, and
            # input_scale_inv has input_scale's 2-byte dtype.
            result["device_bytes_equal_stored"] = w.device_bytes == formats.device_bytes(stored)
        except Exception as exc:  # reported per case by the parent test
            result["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(result), flush=True)


@pytest.fixture(scope="module")
def interpreter_run() -> list[dict]:
    proc = subprocess.run(
        [sys.executable, __file__],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode:
        pytest.fail(f"interpreter subprocess exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_importing_the_package_does_not_import_triton(interpreter_run):
    assert interpreter_run[0] == {"triton_imported_by_package": False}


@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=_case_id)
def test_triton_kernel_under_interpreter_matches_reference(interpreter_run, case):
    for line in interpreter_run:
        if "skip" in line:
            pytest.skip(line["skip"])
    result = next(line for line in interpreter_run if line.get("case") == _case_id(case))
    assert "error" not in result, result["error"]
    assert result["configs"] >= 1
    assert result["max_ratio"] <= 1.0
    assert result["device_bytes_equal_stored"]
    if case[0] == 4:
        assert result["dequant_ratio"] <= 1.0
    if "one_hot_exact" in result:
        # The W4 cases without an input scale are the fp16 ones, which is as well: the
        # interpreter rounds fp32 -> bf16 toward zero (a GPU rounds to nearest), so bf16
        # weights are checked bit for bit on the device machine.
        assert all(result["one_hot_exact"]), result["one_hot_exact"]


# ---- Triton kernels lowered to a GPU binary (no GPU needed) ----------------------------------

# Per-block shared memory every NVIDIA GPU since Ampere can give a kernel (sm_86/sm_89: 99 KiB).
MAX_SHARED_BYTES = 99 * 1024
# Hopper's per-block limit (sm_90: 227 KiB).
HOPPER_SHARED_BYTES = 227 * 1024


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("config_index", [0, -2, -1], ids=["decode", "prefill", "largest"])
def test_triton_kernels_compile_to_sm90_cubins(bits, config_index):
    # The interpreter checks what the kernels compute, not that they lower: this runs Triton's
    # NVIDIA backend and ptxas for an H100 on the decode tile and the two biggest prefill tiles.
    pytest.importorskip("triton")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")
    from morph_kernels import triton_aot, triton_gpu

    config = triton_gpu.configs_for(bits)[config_index]
    kernel = triton_aot.compile_kernel(bits, config, input_scale=bits == 4, capability=90)
    assert kernel.asm["cubin"]
    assert "cp.async" in kernel.asm["ptx"], "the K loop was not software-pipelined"
    # W4's prefill tiles stage BLOCK_M x 128 activations per step: Hopper-sized (an Ampere
    # consumer GPU's autotuner skips what does not fit there and keeps the smaller tiles).
    assert kernel.metadata.shared <= (MAX_SHARED_BYTES if bits == 8 else HOPPER_SHARED_BYTES)
    if bits == 4 and config.kwargs["SWAP"]:
        # The point of SWAP: the dequantized weight is wgmma's register operand, so the weight
        # tile goes global -> shared -> registers and is never stored back to shared memory.
        assert "wgmma.mma_async" in kernel.asm["ptx"]
        assert "dot_op<{opIdx = 0" in kernel.asm["ttgir"]


def test_w4_decode_tile_dequantizes_in_the_mma_operand_layout():
    # The decode tile's packed words are loaded from shared memory straight into wgmma's
    # register-operand layout and the nibbles are converted there: no layout conversion of
    # the weight (which would round-trip it through shared memory) and no int -> float cvt.
    pytest.importorskip("triton")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")
    from morph_kernels import triton_aot, triton_gpu

    config = triton_gpu.candidate_configs(1, 128)[0]
    kernel = triton_aot.compile_kernel(4, config, input_scale=True, capability=90)
    ttgir = kernel.asm["ttgir"]
    assert "-> tensor<64x16xi32, #ttg.dot_op<{opIdx = 0" in ttgir
    weight_conversions = [line for line in ttgir.splitlines()
                          if "ttg.convert_layout" in line and "xi32" in line]
    assert weight_conversions == []
    assert "cvt.rn.f32.s32" not in kernel.asm["ptx"] and "cvt.rn.f32.u32" not in kernel.asm["ptx"]


# ---- Triton kernels on a real GPU ----------------------------------------------------------

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the device machine"
)

# Llama-3-8B: hidden 4096, intermediate 14336, 32 query / 8 KV heads of 128 (fused qkv 6144).
LLAMA3_8B_IN_OUT = {
    "qkv_proj": (4096, 6144),
    "o_proj": (4096, 4096),
    "gate_up_proj": (4096, 2 * 14336),
    "down_proj": (14336, 4096),
}
GPU_TOKENS = (1, 8, 32, 512, 1000)  # decode batches and prefill chunks (1000: ragged tile)
GPU_VARIANTS = [
    (8, None, False, torch.bfloat16),
    (4, 128, False, torch.bfloat16),
    (4, 128, True, torch.bfloat16),
    (4, 64, True, torch.float16),
]


def _gpu_weight(bits, group_size, input_scale, act_dtype, in_out, warmup_tokens):
    in_features, out_features = in_out
    stored = make_stored(
        bits, out_features, in_features, group_size=group_size, input_scale=input_scale,
        device="cuda",
    )
    w = morph_kernels.prepare(bits, stored, device="cuda", act_dtype=act_dtype)
    morph_kernels.warmup(w, warmup_tokens)
    return stored, w


@needs_cuda
@pytest.mark.parametrize("variant", GPU_VARIANTS, ids=lambda v: f"w{v[0]}-g{v[1]}-is{v[2]}-{v[3]}")
@pytest.mark.parametrize("layer", LLAMA3_8B_IN_OUT)
def test_gpu_llama3_8b_shapes_match_reference(layer, variant):
    bits, group_size, input_scale, act_dtype = variant
    stored, w = _gpu_weight(bits, group_size, input_scale, act_dtype, LLAMA3_8B_IN_OUT[layer], 1024)
    assert w.device_bytes == formats.device_bytes(stored)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for tokens in GPU_TOKENS:
        x = torch.randn(tokens, w.in_features, generator=gen, device="cuda").to(act_dtype)
        assert_within_bound(morph_kernels.linear(x, w), x, stored, bits, None)


def _compiled_and_tuned() -> tuple[int, int, int]:
    """(compiled kernel binaries, autotuned keys, chosen W4 backends) of the GPU kernels."""
    from morph_kernels import triton_gpu

    compiled = sum(
        len(cache[0])
        for kernel in (triton_gpu._w8a16_kernel, triton_gpu._w4a16_kernel,
                       triton_gpu._w4_dequant_kernel)
        for cache in kernel.device_caches.values()
    )
    tuned = len(triton_gpu._w8a16_tuned.cache) + len(triton_gpu._w4a16_tuned.cache)
    return compiled, tuned, len(triton_gpu.w4_choices())


@needs_cuda
def test_gpu_warmup_leaves_nothing_to_compile_or_tune():
    weights = [
        _gpu_weight(bits, group_size, input_scale, torch.bfloat16, (4096, 4096), 2048)[1]
        for bits, group_size, input_scale in ((8, None, False), (4, 128, True))
    ]
    before = _compiled_and_tuned()
    for w in weights:
        for tokens in (1, 2, 3, 7, 16, 17, 100, 257, 1000, 2048):
            morph_kernels.linear(torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16), w)
    torch.cuda.synchronize()
    assert _compiled_and_tuned() == before


# Listed here rather than read from triton_gpu, whose import would import Triton at collection.
W4_GPU_BACKENDS = ("triton", "dequant_cublas")


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_w4_input_scale_is_one_rounding_of_the_fp32_product(act_dtype):
    # dequant_cublas scales the activation with one multiply in the act dtype; the GEMM does
    # it in fp32 and rounds once. Both must give the same bits.
    pytest.importorskip("triton")
    from morph_kernels import triton_gpu

    stored = make_stored(4, OUT_FEATURES, W4_IN_FEATURES, group_size=64, input_scale=True)
    tensors = triton_gpu.prepare_tensors(4, stored, act_dtype)
    w = morph_kernels.PreparedWeight(4, OUT_FEATURES, W4_IN_FEATURES, 64, tensors, act_dtype)
    x = torch.randn(33, W4_IN_FEATURES).to(act_dtype)
    inv = tensors["input_scale_inv"]
    assert torch.equal(triton_gpu._scaled_input(x, w), (x.float() * inv.float()).to(act_dtype))


def test_every_w4_backend_is_tested_on_the_gpu():
    pytest.importorskip("triton")
    from morph_kernels import triton_gpu

    assert triton_gpu.W4_BACKENDS == W4_GPU_BACKENDS


@needs_cuda
@pytest.mark.parametrize("backend", W4_GPU_BACKENDS)
@pytest.mark.parametrize("layer", ["o_proj", "down_proj", "gate_up_proj"])
def test_gpu_w4_backend_matches_reference_and_dequantizes_exactly(layer, backend):
    from morph_kernels import triton_gpu

    for input_scale in (False, True):
        stored, w = _gpu_weight(4, 128, input_scale, torch.bfloat16, LLAMA3_8B_IN_OUT[layer], 1)
        for tokens in (1, 16, 512):
            x = torch.randn(tokens, w.in_features, device="cuda").to(torch.bfloat16)
            assert_within_bound(triton_gpu.linear(x, w, backend=backend), x, stored, 4, None)
        if not input_scale:
            assert _one_hot_exact(lambda v: triton_gpu.linear(v, w, backend=backend), stored,
                                  torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("backend", W4_GPU_BACKENDS)
def test_gpu_w4_backend_replays_in_a_cuda_graph(backend):
    from morph_kernels import triton_gpu

    stored, w = _gpu_weight(4, 128, True, torch.bfloat16, (4096, 6144), 1)
    x = torch.randn(16, 4096, device="cuda").to(torch.bfloat16)
    triton_gpu.linear(x, w, backend=backend)  # compiles and tunes outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = triton_gpu.linear(x, w, backend=backend)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert_within_bound(y, x, stored, 4, None)


@needs_cuda
def test_gpu_warmup_chooses_an_agreeing_backend_per_bucket():
    from morph_kernels import triton_gpu

    _, w = _gpu_weight(4, 64, True, torch.bfloat16, (4096, 4096), 64)
    chosen = {key[-1]: value for key, value in triton_gpu.w4_choices().items()
              if key[1:5] == (4096, 4096, 64, torch.bfloat16)}
    assert {1, 2, 4, 8, 16, 32, 64} <= set(chosen)
    for choice, timings in chosen.values():
        assert "triton" in timings and choice == min(timings, key=timings.get)


@needs_cuda
@pytest.mark.parametrize("act_dtype,group_size,input_scales",
                         [(torch.bfloat16, 128, (False, True)), (torch.float16, 64, (True,))],
                         ids=["bf16-g128", "fp16-g64"])
def test_gpu_every_w4_configuration_matches_reference(act_dtype, group_size, input_scales):
    # Each autotune candidate on its own, the bf16x2 inline-PTX conversion (PAIRS) included:
    # the autotuner runs whichever is fastest, so every one must be right, and bit-exact in its
    # weights. K = 4160 is not a multiple of BLOCK_K = 128 for g64 (a short last step); N =
    # 6208 is not a multiple of BLOCK_N = 128. (Group sizes and dtypes as the other GPU tests,
    # so nothing new compiles.)
    from morph_kernels import triton_gpu

    in_features = 4160 if group_size == 64 else 4224
    for input_scale in input_scales:
        stored = make_stored(4, 6208, in_features, group_size=group_size,
                             input_scale=input_scale, device="cuda")
        w = morph_kernels.prepare(4, stored, device="cuda", act_dtype=act_dtype)
        for tokens in (1, 16, 40, 300):
            bucket = triton_gpu.m_bucket(tokens)
            configs = triton_gpu.candidate_configs(bucket, group_size, act_dtype)
            assert any(c.kwargs.get("PAIRS") for c in configs) == (act_dtype == torch.bfloat16)
            x = torch.randn(tokens, in_features, device="cuda").to(act_dtype)
            for config in configs:
                assert_within_bound(triton_gpu.linear(x, w, None, config), x, stored, 4, None)
                if not input_scale and tokens == 16:
                    assert _one_hot_exact(lambda v, c=config: triton_gpu.linear(v, w, None, c),
                                          stored, act_dtype), config


@needs_cuda
def test_gpu_linear_replays_in_a_cuda_graph_with_bias_and_3d_input():
    stored, w = _gpu_weight(4, 128, True, torch.bfloat16, (4096, 6144), 16)
    bias = torch.randn(6144, device="cuda").to(torch.bfloat16)
    x = torch.randn(2, 4, 4096, device="cuda").to(torch.bfloat16)
    morph_kernels.linear(x, w, bias)  # eager first, as SGLang does before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = morph_kernels.linear(x, w, bias)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, morph_kernels.linear(x, w, bias))
    assert_within_bound(y.view(8, 6144), x.view(8, 4096), stored, 4, bias)


if __name__ == "__main__":
    _interpreter_main()
