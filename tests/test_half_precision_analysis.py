"""Spectra, norms, SVDs and composition of 16-bit models (bf16, fp16) on the CPU, where LAPACK and
torch have no 16-bit kernels: they are widened to float32, so they must equal the float32 results
on the same (rounded) weights, and stay near the float32 model's."""

import pytest
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import circuits
from pycircuits_widgets.analysis.composition import composition_detail, composition_scores
from pycircuits_widgets.analysis.eigen import eigenvalue_positivity
from pycircuits_widgets.analysis.induction import k_composition_positivity
from pycircuits_widgets.analysis.virtual_heads import virtual_head_norms

PAIR = ((0, 1), (1, 2))


def analyses(model):
    """Every 16-bit-sensitive analysis of ``model``, as float64 tensors keyed by name."""
    out = {}
    for kind in "QKV":
        detail = composition_detail(model, kind, *PAIR)
        out[f"detail {kind}"] = torch.tensor([detail.score, *detail.erratum_scores.values(), detail.positivity])
        out[f"singular values {kind}"] = detail.singular_values
        out[f"scores {kind}"] = composition_scores(model, kind, baseline=False)[0, :, 1]
    for kind in ("OV", "QK"):
        out[f"positivity {kind}"] = eigenvalue_positivity(model, kind)
    ov = circuits.ov(model)
    out["OV norm"], out["OV S"] = ov.norm(), ov.S
    out["OV spectrum"] = ov.eigenvalues.abs().sort(-1).values
    out["OV eigenvalue magnitudes"] = ov.eigenvalues.abs().sum(-1)
    out["virtual head norms"] = virtual_head_norms(model)[0, :, 1]
    out["K-composition positivity"] = k_composition_positivity(model)[0, :, 1]
    return {name: value.double() for name, value in out.items()}


@pytest.fixture(scope="module")
def float32_model():
    return pcw.load_pretrained("attn-only-2l")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_model_analyses_equal_float32_on_the_same_weights(float32_model, dtype):
    half = pcw.load_pretrained("attn-only-2l").to(dtype)
    assert half.W_E.dtype == dtype
    rounded = pcw.load_pretrained("attn-only-2l").to(dtype).to(torch.float32)  # the same numbers, float32
    got, same, original = analyses(half), analyses(rounded), analyses(float32_model)
    for name in got:
        # widened to float32 before any product: the float32 computation on the rounded weights. The same
        # code on the same values (bit-identical on one machine), but MKL does not promise the same bits
        # from two runs whose arrays sit at other addresses; the margin separates float32 reorderings
        # (~1e-7 relative) from a product taken in 16 bits (~2^-8 for bf16). Not a derived bound: each
        # analysis's own float32 error model would be needed (see the composition/eigen tests).
        torch.testing.assert_close(got[name], same[name], rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        # and the 16-bit rounding of the weights moves nothing by more than 2% (or 5e-3): not a rounding
        # tolerance but the size of the weights' own perturbation (bf16's u = 2^-8 per weight, through
        # products of four factors and ratios of norms), with room for the circuits' cancellation
        # (except single eigenvalues of these non-normal circuits: ill-conditioned, several % apart;
        # their magnitudes' sum is not)
        if name != "OV spectrum":
            torch.testing.assert_close(got[name], original[name], rtol=2e-2, atol=5e-3, msg=lambda m, name=name: f"{name}: {m}")


def test_16_bit_results_come_back_in_float32(float32_model):
    half = pcw.load_pretrained("attn-only-2l").to(torch.bfloat16)
    assert composition_scores(half, "V", baseline=False).dtype == torch.float32
    assert composition_detail(half, "V", *PAIR).singular_values.dtype == torch.float32
    ov = circuits.ov(half)
    assert ov.norm().dtype == torch.float32 and ov.svd()[0].dtype == torch.float32
    assert ov.eigenvalues.dtype == torch.complex64
