"""The quality guard: each block's attention error measured on the run's own inputs, held to a target.

* blocks.py  -- which block a call belongs to (``transformer_options["block_index"]``, which SafeSage
  fills in for MiniMax H3 through ComfyUI's own ``patches_replace["dit"]``; else the n-th call of
  the forward);
* probe.py   -- one block's error on sampled query rows against ComfyUI's own attention, and a
  candidate kernel's error on the same rows (run on those rows only);
* targets.py -- the target (``quality`` on the node) and the choice per block: the fastest family
  under it;
* guard.py   -- the run: step 1 measures, the end of step 1 chooses, steps 2.. run the choices.
"""
