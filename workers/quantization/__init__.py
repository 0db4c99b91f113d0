"""FP8 checkpoints: which quantization a checkpoint declares, and its weights dequantized.

Three layouts load (``scheme.read_scheme``), each as the released checkpoints and vLLM
read it:

- block-wise FP8 (``quant_method: fp8``, ``weight_block_size``): ``<tensor>_scale_inv``
  per block of the last two dims, multiplied in;
- ModelOpt FP8 (``quant_method: modelopt``, ``quant_algo: FP8``, in ``config.json`` or
  ``hf_quant_config.json``): per-tensor ``weight_scale`` and a static ``input_scale``;
- compressed-tensors FP8 (``float-quantized``, channel or tensor weights, dynamic
  activations): ``weight_scale`` per output row.

The weights are dequantized once at load, to the compute dtype (``stream``): the forward
runs in that dtype with unquantized activations (weight-only FP8, as vLLM's fallback on GPUs
without FP8 GEMMs). Everything else a ``quantization_config`` can say is refused with a
ValueError naming the field.
"""

from workers.quantization.scheme import QuantScheme, read_scheme, scheme_from_config
from workers.quantization.stream import checkpoint_weights, plan_checkpoint

__all__ = ["QuantScheme", "checkpoint_weights", "plan_checkpoint", "read_scheme", "scheme_from_config"]
