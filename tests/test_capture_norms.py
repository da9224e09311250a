"""``fusion.capture`` of the normalizations transformers use (``nn.LayerNorm``,
``nn.RMSNorm``, ``nn.GroupNorm``) and of a GPT-2 block, against eager PyTorch.

Each module is captured, run by the reference evaluator and by generated kernels (Triton's
interpreter here), and compared with the module itself; its backward (``fusion.autodiff``)
is run the same ways and compared with torch autograd's gradients of the input and of
every parameter. A LayerNorm or an RMSNorm must become one normalization kernel, and so
must its backward (dx's row reductions with dweight's and dbias's column sums, as
``examples/norms.py``'s hand-written one): the composition the capture builds, and the
gradients autodiff writes of it, are what the normalization scheduler fuses.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_parallelize import trained_pieces

from fusion import FusionDefinition
from fusion.autodiff import backward
from fusion.capture import capture
from fusion.errors import DefinitionError
from fusion.nn_ops import group_norm, layer_norm, rms_norm
from fusion.testing import assert_close
from overlap import MultiDeviceExecutor

KERNELS = ["reference", "generated"]
DTYPES = [torch.float32, torch.bfloat16]


def _check(module: torch.nn.Module, x: torch.Tensor, kernels: str, extent: int) -> tuple[str, str]:
    """``module`` captured on ``x``: its output, and the gradients of ``x`` and of every
    parameter for a random output gradient, run by ``kernels``, against the module under
    torch autograd (``extent``: the terms a value accumulates). Returns the forward's
    and the backward's kernel reports (empty for the reference).

    The output is compared with the module in ``x``'s dtype. The gradients are compared
    with torch autograd in float32 from the same values, rounded once: torch's bf16 CPU
    backward rounds its intermediates to bf16 (a LayerNorm's weight gradient 0.011 from
    float64's where ours, which accumulates in float32, is 0.006), ours must be the
    closer one."""
    captured = capture(module, [x])
    inputs = captured.inputs(module, x)
    forward = MultiDeviceExecutor(captured.fd, kernels=kernels)
    (ours,) = forward.run(inputs)
    assert_close(ours, module(x).detach(), reduction_extent=extent, message="output")
    seed = torch.randn(ours.shape, generator=torch.Generator().manual_seed(7)).to(x.dtype)
    grads = backward(captured.fd.fusion)
    backward_executor = MultiDeviceExecutor(grads.fusion, kernels=kernels)
    ours_grads = backward_executor.run([*inputs, seed])
    names = [*captured.parameter_names, "input"]
    assert [names[position] for position in grads.wrt] == names  # every one differentiated
    wide = copy.deepcopy(module).float()
    state = dict(wide.named_parameters())
    leaf = x.float().requires_grad_()
    wanted = [*(state[name] for name in captured.parameter_names), leaf]
    expected = torch.autograd.grad(wide(leaf), wanted, seed.float())
    rows = x.numel() // x.shape[-1]
    for name, mine, torchs in zip(names, ours_grads, expected, strict=True):
        # a parameter's gradient sums over the rows too
        terms = extent if name == "input" else extent * rows
        assert_close(mine, torchs.to(x.dtype), reduction_extent=terms,
                     message=f"gradient of {name}")  # fmt: skip
    if kernels != "generated":
        return "", ""
    return forward.kernel_report(), backward_executor.kernel_report()


LAYER_NORMS = {
    # name: (input shape, normalized shape, keyword arguments of nn.LayerNorm)
    "2d": ([7, 12], [12], {}),
    "3d": ([2, 5, 12], [12], {}),
    "3d_no_bias": ([2, 5, 12], [12], {"bias": False}),
    "3d_no_affine": ([2, 5, 12], [12], {"elementwise_affine": False}),
    "two_trailing_dims": ([2, 5, 12], [5, 12], {}),
    "two_trailing_dims_no_bias": ([3, 7, 4], [7, 4], {"bias": False}),
    "odd_hidden": ([3, 4, 7], [7], {"eps": 1e-3}),
}


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(LAYER_NORMS))
def test_layer_norm_matches_eager_with_its_gradients(case, dtype, kernels):
    shape, normalized, options = LAYER_NORMS[case]
    torch.manual_seed(0)
    module = torch.nn.LayerNorm(normalized, **options)
    with torch.no_grad():  # weights away from their 1 and 0, so that a swap would show
        for parameter in module.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape))
    module = module.to(dtype)
    x = (3.0 * torch.randn(shape) + 1.5).to(dtype)  # a mean and a scale to remove
    extent = int(torch.tensor(normalized).prod())
    reports = _check(module, x, kernels, extent)
    if kernels == "generated":  # the whole LayerNorm: one kernel of the normalization
        # scheduler, forward and backward (its weight gradients' column sums in it)
        for report in reports:
            assert report.startswith("k0 [normalization]") and "\n" not in report, report


RMS_NORMS = {
    # name: (input shape, normalized shape, keyword arguments of nn.RMSNorm)
    "3d": ([2, 5, 12], [12], {}),  # eps None: torch's default
    "2d_eps": ([7, 12], [12], {"eps": 1e-3}),
    "no_weight": ([2, 5, 12], [12], {"elementwise_affine": False}),
    "two_trailing_dims": ([3, 7, 4], [7, 4], {"eps": 1e-5}),
}


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(RMS_NORMS))
def test_rms_norm_matches_eager_with_its_gradients(case, dtype, kernels):
    """``nn.RMSNorm`` (``aten.rms_norm`` in the exported graph) is translated, not run
    by torch: one normalization kernel forward and one backward, as LayerNorm's."""
    shape, normalized, options = RMS_NORMS[case]
    torch.manual_seed(8)
    module = torch.nn.RMSNorm(normalized, **options)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape))
    module = module.to(dtype)
    x = (2.0 * torch.randn(shape) + 0.5).to(dtype)
    extent = int(torch.tensor(normalized).prod())
    reports = _check(module, x, kernels, extent)
    if kernels == "generated":
        for report in reports:
            assert report.startswith("k0 [normalization]") and "\n" not in report, report


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
def test_rms_norm_without_eps_adds_torchs_machine_epsilon(dtype):
    """Rows whose mean square is about the epsilon, so that the one added shows: torch's
    default is the machine epsilon of the compute type (float32's for bf16 inputs, which
    bf16's own 2^-7 would swamp; float64's for float64), and no op falls back to torch."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    torch.manual_seed(9)
    module = torch.nn.RMSNorm(12).to(dtype)
    x = (torch.finfo(compute).eps ** 0.5 * torch.randn(3, 12)).to(dtype)
    captured = capture(module, [x])
    assert "fell back to torch" not in str(captured.fd), captured.fd
    (ours,) = captured.fd.execute(captured.inputs(module, x))
    assert_close(ours, module(x).detach(), reduction_extent=12)


def parallel_rms_norm(communicator) -> tuple[list[str], list[str]]:
    """An ``nn.RMSNorm`` on a sequence split over the ranks (7 tokens: uneven pieces),
    trained one step (``trained_pieces``): rows stay whole on a rank, the weight's
    gradient sums over every rank's rows."""
    torch.manual_seed(10)
    module = torch.nn.RMSNorm(16)
    with torch.no_grad():
        module.weight.add_(0.3 * torch.randn(16))
    return trained_pieces(communicator, module, {}, 7, "sequence", 16)


def test_an_rms_norm_over_a_sequence_split_over_two_ranks_trains_as_one_device(rank_pools):
    """No communication in the forward: each rank normalizes its own tokens."""
    results = rank_pools(2).run(parallel_rms_norm, timeout=120)
    assert results == [(["weight [16]"], [])] * 2


GROUP_NORMS = {
    # name: (input shape, groups, channels, affine)
    "three_groups": ([2, 6, 5], 3, 6, True),
    "image": ([2, 4, 3, 5], 2, 4, True),
    "no_affine": ([2, 4, 3, 5], 2, 4, False),
    "one_group": ([3, 4, 7], 1, 4, True),
    "a_group_a_channel": ([2, 3, 7], 3, 3, True),
}


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(GROUP_NORMS))
def test_group_norm_matches_eager_with_its_gradients(case, dtype, kernels):
    shape, groups, channels, affine = GROUP_NORMS[case]
    torch.manual_seed(1)
    module = torch.nn.GroupNorm(groups, channels, affine=affine)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape))
    module = module.to(dtype)
    x = (2.0 * torch.randn(shape) - 1.0).to(dtype)
    extent = channels // groups * int(torch.tensor(shape[2:]).prod())
    report, backward_report = _check(module, x, kernels, extent)
    if kernels == "generated":  # the statistics and the normalization: one kernel
        assert "[normalization]" in report, report
    if kernels == "generated" and dtype == torch.float32:
        # the backward: dx's row sums one normalization kernel; with a weight, its product
        # with dy and dy's with x-hat a pointwise kernel before it (the bias's sum of dy,
        # which no scheduler takes, joins the reference evaluator's launch of its view
        # instead of splitting them: 4 kernels before)
        schedulers = [line.split()[1] for line in backward_report.splitlines()]
        expected = ["[normalization]", "[pointwise]", "[normalization]"] if affine else [
            "[normalization]"]  # fmt: skip
        assert schedulers == expected, backward_report


class KeepdimRMSNorm(torch.nn.Module):
    """RMSNorm in elementwise ops as Hugging Face's Llama writes it, float32 statistics
    kept as [..., 1] (``keepdim``), but rounded back once at the end (Llama rounds before
    the weight, which ``_check``'s float32 copy of the module would not)."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        wide = x.to(torch.float32)
        variance = wide.pow(2).mean(-1, keepdim=True)
        return (self.weight * wide * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [[7, 12], [2, 5, 12]], ids=["2d", "3d"])
def test_an_rmsnorm_in_elementwise_ops_and_its_backward_are_one_kernel_each(shape, dtype, kernels):
    """Its statistics' gradients stay over the rows (no sum over their axis of extent
    1), so dx and dweight are the normalization kernel's, as the forward is."""
    torch.manual_seed(6)
    module = KeepdimRMSNorm(shape[-1])
    with torch.no_grad():
        module.weight.add_(0.3 * torch.randn(shape[-1]))
    module = module.to(dtype)
    x = (2.0 * torch.randn(shape) + 0.5).to(dtype)
    reports = _check(module, x, kernels, shape[-1])
    if kernels == "generated":
        for report in reports:
            assert report.startswith("k0 [normalization]") and "\n" not in report, report


class NativeNorms(torch.nn.Module):
    """The ops a decomposed graph holds: ``native_layer_norm`` and ``native_group_norm``,
    each with its mean and rstd, and ``_fused_rms_norm`` with its rstd."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.2 * torch.randn(6))
        self.bias = torch.nn.Parameter(0.2 * torch.randn(6))

    def forward(self, x):
        batch, channels, length = x.shape
        layer = torch.ops.aten.native_layer_norm(x, [length], self.weight[:length], None, 1e-5)
        group = torch.ops.aten.native_group_norm(x, self.weight, self.bias, batch, channels,
                                                 length, 3, 1e-4)  # fmt: skip
        rms = torch.ops.aten._fused_rms_norm(x, [length], self.bias[:length], None)
        return (*layer, *group, *rms)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_native_norms_and_their_statistics_match_torch(dtype):
    torch.manual_seed(2)
    module = NativeNorms().to(dtype)
    x = (torch.randn(2, 6, 5) + 0.5).to(dtype)
    captured = capture(module, [x])
    ours = MultiDeviceExecutor(captured.fd, kernels="generated").run(captured.inputs(module, x))
    names = ["layer y", "layer mean", "layer rstd", "group y", "group mean", "group rstd",
             "rms y", "rms rstd"]  # fmt: skip
    for name, mine, theirs in zip(names, ours, module(x), strict=True):
        # torch's CPU statistics are in the input's dtype, the layer's with its axis kept;
        # the RMS norm's rstd is float32 (its compute type), its axis kept
        assert_close(mine, theirs.detach(), reduction_extent=10, message=name)


class GPT2Block(torch.nn.Module):
    """A GPT-2 block: pre-LayerNorm causal self-attention (biased q, k, v and output
    projections, heads by ``scaled_dot_product_attention``) and a tanh-GELU MLP (biased
    ``fc`` and ``proj``), each added to the residual stream; inputs [batch, seq, hidden]."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = torch.nn.LayerNorm(hidden)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(hidden, hidden) for _ in "qkvo")
        self.ln_2 = torch.nn.LayerNorm(hidden)
        self.fc = torch.nn.Linear(hidden, 4 * hidden)
        self.proj = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        batch, seq, hidden = x.shape
        normed = self.ln_1(x)
        q, k, v = (proj(normed).view(batch, seq, self.heads, -1).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))  # fmt: skip
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attended.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


def gpt2_block() -> GPT2Block:
    """The same GPT-2 block wherever it is made (hidden 16, 4 heads), its LayerNorms'
    weights and biases away from 1 and 0."""
    torch.manual_seed(3)
    module = GPT2Block(16, 4)
    with torch.no_grad():
        for norm in (module.ln_1, module.ln_2):
            norm.weight.add_(0.3 * torch.randn(16))
            norm.bias.add_(0.3 * torch.randn(16))
    return module


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_gpt2_block_trains_as_the_module(kernels):
    module = gpt2_block()
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(4))
    report, _ = _check(module, x, kernels, extent=64)
    if kernels == "generated":  # both LayerNorms fused (softmax is torch's attention's)
        assert report.count("[normalization]") == 2, report


GPT2_PLAN = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise",
             "fc": "colwise", "proj": "rowwise"}  # fmt: skip


def parallel_gpt2(communicator, kernels: str) -> tuple[list[str], list[str]]:
    """The GPT-2 block's heads and MLP split over the ranks by ``GPT2_PLAN``, the
    LayerNorms whole, trained one step on [2, 7, 16] (``trained_pieces``: this rank's
    output and every gradient piece against the module's). Returns the pieces' shapes
    and the forward's communications."""
    return trained_pieces(communicator, gpt2_block(), GPT2_PLAN, 7, "replicate", 64,
                          batch=(2,), kernels=kernels)  # fmt: skip


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_gpt2_block_parallel_over_two_ranks_trains_as_one_device(rank_pools, kernels):
    """Megatron's communications, as torch's tensor parallelism: an all-reduce after each
    row-wise linear (its bias added after it), no weight moved."""
    results = rank_pools(2).run(parallel_gpt2, kernels, timeout=300)
    # the heads and the MLP's hidden features halved, the LayerNorms and the row-wise
    # linears' biases whole
    halved = {"q", "k", "v", "fc"}
    shapes = []
    for name, parameter in gpt2_block().named_parameters():
        shape = list(parameter.shape)
        owner, kind = name.split(".")
        if owner in halved:
            shape[0] //= 2
        elif owner in {"o", "proj"} and kind == "weight":
            shape[1] //= 2
        shapes.append(f"{name} {shape}")
    assert results == [(shapes, ["Allreduce", "Allreduce"])] * 2


def test_a_group_norm_over_a_symbolic_length_reduces_its_axes_unmerged():
    """A symbolic trailing axis cannot be merged with the channels of a group: the
    statistics reduce over both axes, still torch's group norm at any length."""
    with FusionDefinition("group_norm") as fd:
        x = fd.define_tensor([2, 6, "length"], "float32")
        weight = fd.define_tensor([6], "float32")
        y, mean, rstd = group_norm(x, 3, weight, None, eps=1e-3)
        fd.add_output(y)
    assert list(mean.shape) == [2, 3] and list(rstd.shape) == [2, 3]
    generator = torch.Generator().manual_seed(5)
    for length in (1, 9):
        values = torch.randn(2, 6, length, generator=generator)
        scale = torch.randn(6, generator=generator)
        (ours,) = fd.execute([values, scale])
        wanted = F.group_norm(values, 3, scale, None, eps=1e-3)
        assert_close(ours, wanted, reduction_extent=2 * length, message=f"length {length}")


def test_norms_that_do_not_fit_their_input_are_refused():
    with FusionDefinition("refused") as fd:
        x = fd.define_tensor([2, 6, 4], "float32")
        with pytest.raises(DefinitionError, match="normalized_dims must be 1 to 3"):
            layer_norm(x, 4)
        with pytest.raises(DefinitionError, match="6 channels .* in 4 groups"):
            group_norm(x, 4)
        with pytest.raises(DefinitionError, match="weight .* does not match"):
            layer_norm(x, 2, fd.define_tensor([4], "float32"))
        with pytest.raises(DefinitionError, match="normalized_dims must be 1 to 3"):
            rms_norm(x, 0)
        fd.add_output(layer_norm(x, 2)[0])  # the fitting ones are still built
