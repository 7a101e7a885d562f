"""Tensors a module keeps as plain attributes (views of its parameters, token ids) after a load and a materialize,
against eager construction + load_state_dict of the same file: values, devices, shared memory, gradients."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import materialize as mz


def _zero_argument_views() -> list[str]:
    """Every public method or property of ``torch.Tensor`` that, called with no argument on a 2-D parameter,
    returns a view of it (or a sequence of views): found by asking torch, not listed by hand."""
    weight = nn.Parameter(torch.randn(4, 6))
    found = []
    for name in sorted(dir(torch.Tensor)):
        if name.startswith("_") or name.endswith("_") or name in _NOT_ASKED:
            continue
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            try:
                value = getattr(weight, name)
                value = value() if callable(value) else value
            except Exception:  # noqa: BLE001 - a method that needs arguments, or another dtype
                continue
        if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
            name, value = f"{name}[0]", value[0]
        if isinstance(value, torch.Tensor) and value._base is weight:
            found.append(name)
    return found


_NOT_ASKED = {"backward", "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "share_memory",
              "pin_memory", "cuda", "tolist", "numpy", "storage", "untyped_storage", "record_stream", "grad", "data"}

# Views that take arguments: torch's documented view ops (docs: tensor_view), each with arguments for a 4x6 weight.
_VIEWS_WITH_ARGUMENTS = {
    "transpose(0,1)": lambda w: w.transpose(0, 1),
    "permute(1,0)": lambda w: w.permute(1, 0),
    "narrow(1,1,3)": lambda w: w.narrow(1, 1, 3),
    "select(0,2)": lambda w: w.select(0, 2),
    "[1:3]": lambda w: w[1:3],
    "[:,::2]": lambda w: w[:, ::2],
    "view(-1)": lambda w: w.view(-1),
    "view(3,8)": lambda w: w.view(3, 8),
    "reshape(6,4)": lambda w: w.reshape(6, 4),
    "unsqueeze(0)": lambda w: w.unsqueeze(0),
    "expand(2,4,6)": lambda w: w.expand(2, 4, 6),
    "split(2)[1]": lambda w: w.split(2)[1],
    "chunk(3,dim=1)[2]": lambda w: w.chunk(3, dim=1)[2],
    "unflatten(1,(2,3))": lambda w: w.unflatten(1, (2, 3)),
    "movedim(0,1)": lambda w: w.movedim(0, 1),
    "as_strided((2,2),(1,6),3)": lambda w: w.as_strided((2, 2), (1, 6), 3),
    "view(torch.int32)": lambda w: w.view(torch.int32),
    "unfold(1,2,2)": lambda w: w.unfold(1, 2, 2),
    "diagonal(offset=1)": lambda w: w.diagonal(offset=1),
}


def _view_of(name: str):
    if name in _VIEWS_WITH_ARGUMENTS:
        return _VIEWS_WITH_ARGUMENTS[name]
    attribute, _, index = name.partition("[")

    def view(weight: torch.Tensor) -> torch.Tensor:
        value = getattr(weight, attribute)
        value = value() if callable(value) else value
        return value[0] if index else value

    return view


VIEWS = _zero_argument_views() + list(_VIEWS_WITH_ARGUMENTS)


class _KeepsAView(nn.Module):
    def __init__(self, view: str, grad: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.register_buffer("table", torch.randn(4, 6))  # real under meta_init: its view stays as it is
        with torch.set_grad_enabled(grad):
            self.kept = _view_of(view)(self.lin.weight)
            self.of_table = _view_of(view)(self.table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = self.kept if self.kept.is_floating_point() else self.kept.float()
        return self.lin(x).sum() + kept.sum()


def _assert_like_eager(model: nn.Module, reference: nn.Module) -> None:
    for attr in ("kept", "of_table"):
        ours, theirs = getattr(model, attr), getattr(reference, attr)
        assert ours.device == theirs.device and ours.dtype == theirs.dtype, attr
        assert tuple(ours.shape) == tuple(theirs.shape) and tuple(ours.stride()) == tuple(theirs.stride()), attr
        assert torch.equal(ours, theirs), attr
        assert ours.requires_grad == theirs.requires_grad, attr
    x = torch.randn(2, 6)
    if _MULTIPLE_VIEWS_ERROR in _raised(reference, x):
        # Deliberate difference (docs/limits.md): eager's view, one of several an op returned (unbind, split,
        # chunk), fails in a forward once load_state_dict wrote its base in place; ours, made anew, does not.
        assert model(x).shape == ()
        return
    assert torch.equal(model(x), reference(x))
    if reference.kept.grad_fn is not None:  # the same gradient reaches the weight through the view
        model(x).backward()
        reference(x).backward()
        assert torch.equal(model.lin.weight.grad, reference.lin.weight.grad)
    # It shares the parameter's memory, as eager's does: a step of training moves both.
    assert model.kept.untyped_storage().data_ptr() == model.lin.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        model.lin.weight.add_(1.0)
        reference.lin.weight.add_(1.0)
        assert torch.equal(model.kept, reference.kept)


_MULTIPLE_VIEWS_ERROR = "This view is the output of a function that returns multiple views"


def _raised(model: nn.Module, x: torch.Tensor) -> str:
    try:
        model(x)
    except RuntimeError as error:
        return str(error)
    return ""


@pytest.mark.parametrize("view", VIEWS)
def test_a_view_of_a_parameter_kept_as_an_attribute_follows_the_load(tmp_path, view):
    # It stayed on meta: `x @ kept` on the CPU read memory nobody wrote.
    assert {"t", "mT", "T", "squeeze", "diagonal"} <= set(VIEWS)  # the generated family has the usual ones
    torch.manual_seed(0)
    torch.save(_KeepsAView(view).state_dict(), tmp_path / "model.pt")
    reference = _KeepsAView(view)
    reference.load_state_dict(torch.load(tmp_path / "model.pt"))
    with mz.meta_init():
        model = _KeepsAView(view)
    assert model.kept.is_meta

    with warnings.catch_warnings():
        warnings.simplefilter("error", mz.MaterializeWarning)
        mz.load(model, tmp_path / "model.pt")

    _assert_like_eager(model, reference)


@pytest.mark.parametrize("view", VIEWS)
def test_a_view_of_a_parameter_kept_as_an_attribute_is_materialized_over_it(view):
    torch.manual_seed(0)
    reference = _KeepsAView(view)
    torch.manual_seed(0)
    model = mz.deferred_init(_KeepsAView, view)

    mz.materialize(model)

    _assert_like_eager(model, reference)


@pytest.mark.parametrize("how", ["load", "materialize"])
def test_a_view_made_without_gradients_has_none_as_eagers(tmp_path, how):
    torch.manual_seed(0)
    torch.save(_KeepsAView("t", grad=False).state_dict(), tmp_path / "model.pt")
    reference = _KeepsAView("t", grad=False)
    if how == "load":
        reference.load_state_dict(torch.load(tmp_path / "model.pt"))
        with mz.meta_init():
            model = _KeepsAView("t", grad=False)
        mz.load(model, tmp_path / "model.pt")
    else:
        torch.manual_seed(0)
        reference = _KeepsAView("t", grad=False)
        torch.manual_seed(0)
        model = mz.materialize(mz.deferred_init(_KeepsAView, "t", grad=False))

    assert model.kept.grad_fn is None and model.kept.requires_grad  # as torch makes a view under no_grad
    if how == "materialize":
        assert reference.kept.grad_fn is None
        _assert_like_eager(model, reference)
    else:  # eager's view, written by load_state_dict, now fails when used with gradients on (torch's own rule)
        with torch.no_grad():
            assert torch.equal(model.kept, reference.kept)
        assert model(torch.randn(2, 6)).shape == ()


def test_a_view_follows_a_load_in_another_dtype_and_a_mapped_load(tmp_path):
    torch.manual_seed(0)
    torch.save(_KeepsAView("t").state_dict(), tmp_path / "model.pt")
    for options in ({"dtype": "bf16"}, {"mmap": True}):
        with mz.meta_init():
            model = _KeepsAView("t")
        mz.load(model, tmp_path / "model.pt", **options)
        assert model.kept.dtype == model.lin.weight.dtype
        assert torch.equal(model.kept, model.lin.weight.t())
        assert model.kept.untyped_storage().data_ptr() == model.lin.weight.untyped_storage().data_ptr()


class _PromptTokens(nn.Module):
    """What peft's prompt tuning keeps: token ids made in construction, a plain attribute, and a table of
    virtual tokens; plus a value computed from a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(8, 4)
        self.prompt_tokens = torch.arange(8).long()
        self.noise = torch.randn(3)
        self.norm = self.embedding.weight.norm()

    def forward(self) -> torch.Tensor:
        return self.embedding(self.prompt_tokens)


def test_plain_tensors_a_recorded_construction_made_are_materialized_as_eager_made_them():
    # prompt_tokens stayed on meta: peft's prompt tuning failed with "Cannot copy out of meta tensor".
    torch.manual_seed(0)
    reference = _PromptTokens()
    torch.manual_seed(0)
    model = mz.deferred_init(_PromptTokens)

    mz.materialize(model)

    for attr in ("prompt_tokens", "noise", "norm"):
        ours, theirs = getattr(model, attr), getattr(reference, attr)
        assert not ours.is_meta and ours.dtype == theirs.dtype and torch.equal(ours, theirs), attr
    assert torch.equal(model(), reference())
    assert model.norm.requires_grad == reference.norm.requires_grad  # recorded; eager's also has a graph (docs)


def test_a_plain_tensor_computed_from_a_weight_on_meta_is_named_after_a_load(tmp_path):
    torch.manual_seed(0)
    torch.save(_PromptTokens().state_dict(), tmp_path / "model.pt")
    with mz.meta_init():
        model = _PromptTokens()

    with pytest.warns(mz.MaterializeWarning, match=r"^'norm' stays on meta: a plain tensor attribute") as caught:
        mz.load(model, tmp_path / "model.pt")

    assert len(caught) == 1
    assert model.norm.is_meta and not model.prompt_tokens.is_meta  # real when made: left alone
    # What the warning says to do works: computed after the load, it is the loaded weight's.
    model.norm = model.embedding.weight.norm()
    assert torch.equal(model.norm, torch.load(tmp_path / "model.pt")["embedding.weight"].norm())


def test_plain_tensors_of_a_recorded_model_are_replayed_by_a_load_too(tmp_path):
    torch.manual_seed(0)
    reference = _PromptTokens()
    torch.save(reference.state_dict(), tmp_path / "model.pt")
    torch.manual_seed(0)
    model = mz.deferred_init(_PromptTokens)

    with warnings.catch_warnings():
        warnings.simplefilter("error", mz.MaterializeWarning)
        mz.load(model, tmp_path / "model.pt")

    for attr in ("prompt_tokens", "noise", "norm"):
        assert torch.equal(getattr(model, attr), getattr(reference, attr)), attr
    assert torch.equal(model(), reference())


def _older_norms() -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's older weight_norm, as diffusers' audio VAEs use it
        return nn.Sequential(nn.utils.weight_norm(nn.Conv1d(2, 2, 3)), nn.utils.spectral_norm(nn.Linear(3, 3)))


def test_the_weight_torchs_older_norms_keep_as_an_attribute_is_computed_from_the_loaded_tensors(tmp_path):
    # It stayed on meta (diffusers' AutoencoderOobleck): computed by the forward pre-hook from weight_g/weight_v.
    torch.save(_older_norms().state_dict(), tmp_path / "model.pt")
    reference = _older_norms()
    reference.load_state_dict(torch.load(tmp_path / "model.pt"))
    with mz.meta_init():
        model = _older_norms()

    with warnings.catch_warnings():
        warnings.simplefilter("error", mz.MaterializeWarning)
        mz.load(model, tmp_path / "model.pt")

    assert not model[0].weight.is_meta and not model[1].weight.is_meta
    expected_state = reference.state_dict()
    for name, value in model.state_dict().items():  # spectral norm's _u and _v are the file's: no iteration ran
        assert torch.equal(value, expected_state[name]), name
    # spectral_norm's attribute is its weight_orig's memory until a forward, eagerly too: a view, remade.
    assert torch.equal(model[1].weight, reference[1].weight)
    assert model[1].weight.untyped_storage().data_ptr() == model[1].weight_orig.untyped_storage().data_ptr()
    model.eval(), reference.eval()
    x, y = torch.randn(1, 2, 5), torch.randn(1, 3)
    computed = model[0].weight.clone()
    assert torch.equal(model[0](x), reference[0](x)) and torch.equal(model[1](y), reference[1](y))
    # weight_norm's is computed from the loaded tensors, as the forward computes it (eager's attribute holds the
    # values computed from construction's weight until then: docs/limits.md).
    assert torch.equal(computed, reference[0].weight)
