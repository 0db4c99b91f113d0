"""Inkling2-Loop (``Inkling2LoopForCausalLM``, thinkingmachines/Inkling-2-Mini's text model):
Inkling2 (``workers/models/inkling2.py``) whose layers ``loop_layer_index_start`` ..
``loop_layer_index_end - 1`` run ``loop_num_passes`` times.

Every pass restarts from the hidden state and the blocks the layers before the loop left.
Passes after the first also read *messages* from the previous pass: for loop layer j, a
depth attention (``message_input``: four learned queries per loop layer, for q, k, v and the
MLP) over the blocks the previous pass completed (but its first, which every pass shares)
and its final hidden state; a layer's ``controllers.{attn,k,v,mlp}`` mix each message into
its attention inputs (after the depth attention, before the norms) and into its MLP input:
``(1 - tanh(forget(g))) * x + tanh(gain(g)) * message``, ``g = down([rms(x) | rms(message)])``
(unweighted norms; ``forget`` / ``gain`` fp32). The layers after the loop see the last pass's
blocks.

State: a looped layer keeps its KV and conv windows once per pass (``num_passes`` state
sites, as Zamba2's shared block keeps one per invocation), so the pools hold
``num_hidden_layers + (loop_num_passes - 1) * (loop_end - loop_start)`` layers of state, as
transformers' cache does.

Config fields read: Inkling2's, ``loop_layer_index_start``, ``loop_layer_index_end``,
``loop_num_passes``, ``loop_gate_rank`` (transformers also reads them from ``loop_config``).
Refused (named): ``loop_num_passes`` < 1, a loop start or end that is not a multiple of
``n_layers_per_attn_res_block``, an empty loop or one past the last layer, a loop starting
at layer 0; and Inkling2's refusals. Checkpoints: the released layout transformers writes,
the message queries as ``middle_cycle_cross_pass_queries`` (q and MLP queries of each loop
layer) and ``middle_cycle_cross_pass_kv_queries`` (k and v).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from kernels import dense
from workers.models.inkling2 import Inkling2DecoderLayer, Inkling2ForCausalLM, check_inkling2_config
from workers.models.inkling2_layers import depth_attend, unit_rms
from workers.models.layers import LayerContext, RMSNorm, param
from workers.state_spec import StateSites

MESSAGES = ("attn", "k", "v", "mlp")  # the order of a layer's four messages


class MessageGate(nn.Module):
    """``controllers.<message>``: mixes one message into one input (see the module docstring)."""

    def __init__(self, hidden_size: int, rank: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.down_weight = param(rank, 2 * hidden_size, dtype=dtype)
        self.forget_weight = param(hidden_size, rank, dtype=torch.float32)
        self.gain_weight = param(hidden_size, rank, dtype=torch.float32)

    def forward(self, x: Tensor, message: Tensor) -> Tensor:
        xf, mf = x.float(), message.float()
        both = torch.cat([unit_rms(xf, self.eps), unit_rms(mf, self.eps)], dim=-1)
        g = dense.linear(both.to(self.down_weight.dtype), self.down_weight).float()
        forget = dense.pointwise(torch.tanh, dense.linear(g, self.forget_weight.float()))
        gain = dense.pointwise(torch.tanh, dense.linear(g, self.gain_weight.float()))
        return (1 - forget) * xf + gain * mf


class MessageInput(nn.Module):
    """The message queries: ``queries`` [2L, hidden] (q, MLP of each loop layer) and
    ``kv_queries`` [2L, hidden] (k, v), fp32."""

    def __init__(self, hidden_size: int, num_loop_layers: int) -> None:
        super().__init__()
        self.queries = param(2 * num_loop_layers, hidden_size, dtype=torch.float32)
        self.kv_queries = param(2 * num_loop_layers, hidden_size, dtype=torch.float32)

    def forward(self, blocks: list[Tensor], partial: Tensor, layer: int) -> Tensor:
        """-> loop layer ``layer``'s messages [T, 4, hidden] (q, k, v, MLP) fp32."""
        q, kv = self.queries[2 * layer : 2 * layer + 2], self.kv_queries[2 * layer : 2 * layer + 2]
        return depth_attend(blocks, partial, torch.cat([q[:1], kv, q[1:]]))


class Inkling2LoopLayer(Inkling2DecoderLayer):
    def __init__(self, cfg: Any, index: int, dtype: torch.dtype, sites: StateSites) -> None:
        super().__init__(cfg, index, dtype, sites, num_passes=cfg.loop_num_passes)
        self.controllers = nn.ModuleDict(
            {m: MessageGate(cfg.hidden_size, cfg.loop_gate_rank, cfg.rms_norm_eps, dtype) for m in MESSAGES}
        )

    def message_gate(self, index: int, x: Tensor, messages: Tensor) -> Tensor:
        return self.controllers[MESSAGES[index]](x, messages[:, index])


def check_loop_config(cfg: Any) -> None:
    start, end, passes = cfg.loop_layer_index_start, cfg.loop_layer_index_end, cfg.loop_num_passes
    block = cfg.n_layers_per_attn_res_block
    if passes < 1:
        raise ValueError(f"loop_num_passes={passes} must be at least 1")
    if not 0 < start < end <= cfg.num_hidden_layers:
        raise ValueError(
            f"loop_layer_index_start={start} / loop_layer_index_end={end} must satisfy "
            f"0 < start < end <= num_hidden_layers={cfg.num_hidden_layers}"
        )
    for field, value in (("loop_layer_index_start", start), ("loop_layer_index_end", end)):
        if value % block:
            raise ValueError(f"{field}={value} is not a multiple of n_layers_per_attn_res_block={block}")


class Inkling2LoopForCausalLM(Inkling2ForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(hf_config, dtype, device)
        cfg = self.config
        self.loop = range(cfg.loop_layer_index_start, cfg.loop_layer_index_end)
        self.num_passes = cfg.loop_num_passes
        with torch.device("meta"):
            message_input = MessageInput(cfg.hidden_size, len(self.loop))
        self.model.message_input = message_input.to_empty(device=torch.device(device)).requires_grad_(False)

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        check_inkling2_config(cfg)
        check_loop_config(cfg)

    def _build_layers(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> tuple[list[nn.Module], RMSNorm]:
        loop = range(cfg.loop_layer_index_start, cfg.loop_layer_index_end)
        layers: list[nn.Module] = [
            Inkling2LoopLayer(cfg, i, dtype, sites) if i in loop else Inkling2DecoderLayer(cfg, i, dtype, sites)
            for i in range(cfg.num_hidden_layers)
        ]
        return layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def run_layers(self, hidden: Tensor, blocks: list[Tensor], ctx: LayerContext) -> Tensor:
        layers, loop = self.model.layers, self.loop
        for layer in layers[: loop.start]:
            hidden = layer(hidden, blocks, ctx)
        entry, num_entry_blocks = hidden, len(blocks)
        for layer in layers[loop.start : loop.stop]:
            hidden = layer(hidden, blocks, ctx)
        for invocation in range(1, self.num_passes):
            # the previous pass's blocks but its first (the entry state, the same every pass)
            previous, last = blocks[num_entry_blocks + 1 :], hidden
            hidden = entry
            del blocks[num_entry_blocks:]
            for j, layer in enumerate(layers[loop.start : loop.stop]):
                messages = self.model.message_input(previous, last, j)
                hidden = layer(hidden, blocks, ctx, invocation, messages)
        for layer in layers[loop.stop :]:
            hidden = layer(hidden, blocks, ctx)
        return hidden
