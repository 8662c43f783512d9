"""Bad input to the relay gets a clear error naming the problem; nothing is updated."""
import pytest
import torch
from torch import nn

import l2l_hw
from l2l_hw.models.gpt import GPTConfig, build_gpt, lm_loss
from l2l_hw.relay.stage import RelayError


def relay_for(layers, loss_fn=nn.functional.mse_loss, u=2):
    return l2l_hw.Relay(layers, loss_fn, eps=l2l_hw.make_eps("cpu"), micro_batches=u)


def gpt_relay(u=2):
    torch.manual_seed(0)
    return relay_for(build_gpt(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8)), lm_loss, u)


def unchanged(relay, before):
    after = relay.eps.state_dict()
    return all(torch.equal(before[k], after[k]) for k in before)


def test_wrong_shaped_batch_names_the_layer_and_the_shape():
    relay = gpt_relay()
    before = relay.eps.state_dict()
    tokens = torch.randint(0, 256, (4, 12))  # context 12 > block_size 8
    with pytest.raises(RelayError, match=r"layer 0 \(Embedding\) failed on an input of torch.int64 \(2, 12\)"):
        relay.train_step(tokens, tokens)
    with pytest.raises(ValueError, match="inputs have batch size 4 but targets have 3"):
        relay.train_step(tokens[:, :8], tokens[:3, :8])
    with pytest.raises(ValueError, match="inputs must be a tensor or a tuple of tensors with a batch dimension"):
        relay.train_step(torch.tensor(3), torch.tensor(3))
    assert unchanged(relay, before) and relay.step == 0


class ReturnsDict(nn.Module):
    def forward(self, x):
        return {"x": x}


def test_layer_returning_a_non_tensor_is_named():
    relay = relay_for([nn.Linear(4, 4), ReturnsDict(), nn.Linear(4, 2)])
    with pytest.raises(RelayError, match=r"layer 1 \(ReturnsDict\) returned dict; a layer must return a tensor"):
        relay.train_step(torch.randn(4, 4), torch.randn(4, 2))


def test_loss_that_is_not_a_scalar_is_named():
    relay = relay_for([nn.Linear(4, 2)], loss_fn=lambda out, t: (out - t) ** 2)
    with pytest.raises(RelayError, match=r"loss_fn returned torch.float32 \(2, 2\); it must return the mean loss"):
        relay.train_step(torch.randn(4, 4), torch.randn(4, 2))


def test_more_micro_batches_than_samples_is_refused():
    relay = relay_for([nn.Linear(4, 2)], u=5)
    with pytest.raises(ValueError, match=r"micro_batches=5 is larger than the batch \(4 samples\); use at most 4"):
        relay.train_step(torch.randn(4, 4), torch.randn(4, 2))


def test_bad_relay_arguments_are_refused():
    with pytest.raises(TypeError, match="layer 1 is a str"):
        relay_for([nn.Linear(4, 2), "relu"])
    with pytest.raises(ValueError, match="micro_batches=0: must be a whole number >= 1"):
        relay_for([nn.Linear(4, 2)], u=0)
    with pytest.raises(TypeError, match="eps must be an EPS"):
        l2l_hw.Relay([nn.Linear(4, 2)], nn.functional.mse_loss, eps="cpu")


class FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("boom in backward")


class BackwardBomb(nn.Module):
    def forward(self, x):
        return FailsInBackward.apply(x)


def test_error_after_eager_updates_keeps_the_first_error_and_says_what_was_updated():
    relay = relay_for([nn.Linear(4, 4), BackwardBomb(), nn.Linear(4, 4), nn.Linear(4, 2)])
    with pytest.raises(ValueError, match="boom in backward") as info:
        relay.train_step(torch.randn(4, 4), torch.randn(4, 2))
    assert any("updated in place" in note for note in info.value.__notes__)
    assert relay.step == 0
