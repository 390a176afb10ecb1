"""What a pipeline stage hands torch and what the loss gets back (one process, no process group).

The loss function gets the model's own output type under a pipeline (issue 36): a stage keeps the
tensor it passes on and a recipe to rebuild the model's output around it. A view is never a stage's
output (torch's split backward detaches outputs in place), and what the split backward cannot run
(activation checkpointing, compile) is refused by name.
"""

import pytest
import torch
from torch import nn

from trainmesh._torch.pipeline_output import split_output
from trainmesh._torch.pipeline_split import PassThrough
from trainmesh._torch.pipeline_zero_bubble import check_split_backward, not_a_view


def test_a_tensor_a_tuple_and_a_list_come_back_as_they_were_returned():
    x = torch.randn(2, 3)
    tensor, rebuild = split_output(x)
    assert tensor is x and rebuild(tensor) is x
    tensor, rebuild = split_output((x, torch.zeros(1)))
    assert tensor is x and isinstance(rebuild(x), tuple) and rebuild(x)[0] is x  # outputs[0] reads the logits
    tensor, rebuild = split_output([x])
    assert isinstance(rebuild(x), list) and rebuild(x)[0] is x


def test_a_transformers_output_is_rebuilt_in_its_own_class_around_the_logits():
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    x = torch.randn(2, 4, 8)
    out = modeling_outputs.CausalLMOutputWithPast(logits=x)
    tensor, rebuild = split_output(out)
    rebuilt = rebuild(tensor)
    assert tensor is x and type(rebuilt) is type(out)
    assert rebuilt.logits is x and rebuilt[0] is x  # `outputs.logits` and `outputs[0]` both read it
    hidden = modeling_outputs.BaseModelOutputWithPast(last_hidden_state=x)
    tensor, rebuild = split_output(hidden)
    assert tensor is x and rebuild(x).last_hidden_state is x


def test_an_output_without_a_tensor_to_pass_on_is_refused():
    with pytest.raises(TypeError, match="Received: dict"):
        split_output({"logits": torch.zeros(1)})
    with pytest.raises(TypeError, match="Received: str"):
        split_output("logits")


def test_views_are_handed_on_as_tensors_of_their_own_with_the_same_gradient():
    base = torch.randn(2, 4, 3, requires_grad=True)
    hidden = base * 1.0
    view = hidden[:, slice(0, None)]  # what a causal LM hands its head: all positions, still a view
    own = not_a_view(view)
    assert not own._is_view() and torch.equal(own, view)
    own.detach_()  # what torch's stage_backward_input does to a stage output; a view raises here
    passed = PassThrough()(hidden[:, 1:])
    assert not passed._is_view()
    passed.sum().backward()
    assert base.grad[:, 0].abs().sum() == 0 and torch.equal(base.grad[:, 1:], torch.ones(2, 3, 3))
    plain = torch.randn(2)
    assert not_a_view(plain) is plain and PassThrough()(plain) is plain


def _blocks():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def test_split_backward_refuses_checkpointed_and_compiled_stages_by_name():
    from torch.distributed._composable import checkpoint

    stage = _blocks()
    check_split_backward([stage], "zbv")  # plain stages run
    checkpoint(stage[1])
    check_split_backward([stage], "interleaved_1f1b")  # a schedule that does not split backward
    with pytest.raises(ValueError, match=r"'zbv'.*activation checkpointing.*here: 1\..*'interleaved_1f1b'"):
        check_split_backward([stage], "zbv")
    compiled = _blocks()
    compiled[0].forward = torch.compile(compiled[0].forward, backend="eager")  # as Trainer(compile=...) does
    with pytest.raises(ValueError, match=r"'interleaved_zero_bubble'.*compiled modules.*here: 0.*compile=False"):
        check_split_backward([compiled], "interleaved_zero_bubble")
