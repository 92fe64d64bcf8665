"""The GPU checks: one worker run per runtime and model, and the tables made from them.

``tests/gpu`` (``make test-gpu``) and the GPU benchmark (``python -m deepspeed_zero3.bench.gpu``) both
launch ``worker.py`` once per runtime (the kill switch is read at interpreter start) at world size 1 with
NCCL, ``offload_param: {device: cpu, pin_memory: true}`` and ``overlap_comm``, in bf16. At world size 1
upstream's all-gather takes its no-gather branch, so without the offload a single GPU exercises nothing:
with it, every gather is a pinned host-to-device copy on the all-gather stream, read by compute afterwards.
``tools/gpu_check.sh`` (``make gpu-check``) runs both on a fresh GPU machine and prints one table.
"""
