"""SafeSage past one GPU: sequence-parallel attention (xFuser / yunchang) and raylight's Ray workers.

raylight (komikndr/raylight) runs the model in Ray worker processes that load no custom nodes and
replaces each block's attention forward with xFuser's ``xFuserLongContextAttention``, so neither
SafeSage's attention override nor ComfyUI's ``--use-sage-attention`` reaches the GPUs there. What
reaches a sage kernel is yunchang's ``select_flash_attn_impl(attn_type, stage="fwd-only")``: one call
per rank per key chunk (Ulysses: the whole sequence, heads/U; ring: one call per chunk, outputs merged
by their log-sum-exp). This package guards that call:

  rank_kernel.py   GuardedRankKernel: one rank's call checked against its family's envelope (planned
                   inside it where it is not), the first-call check agreed by every rank, a fallback (PyTorch with LSE) that every
                   rank takes alike, counted in run_stats' "multigpu" section, never raised
  rank_plan.py     a call outside the envelope, planned inside it by the one-GPU planner (copies, head
                   groups, query chunks), run through the selected sage function with its LSE
  lse_reference.py what a refused call runs (PyTorch SDPA with its log-sum-exp) and the LSE half of
                   the first-call check
  xfuser_hook.py   install()/uninstall(): wrap select_flash_attn_impl in yunchang and in every
                   loaded module that imported it (xFuser's ring), sage functions -> families
  worker.py        what runs inside a Ray worker: load safe_ops by path, install the hook, apply
                   SafeSage's node to the worker's model (MLP patch, block index)
  raylight.py      apply_to_workers(ray_actors, ...): send worker.py's entry to every raylight
                   actor the way raylight's own patch nodes do (``model_function_runner``)

Nothing here imports torch.distributed's collectives, yunchang, xFuser, ray or ComfyUI at import
time: each is looked up when used.
"""

#: inside a raylight worker: what worker.apply_in_worker did (worker.report reads it)
WORKER_STATUS: dict = {}
