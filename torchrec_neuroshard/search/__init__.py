"""NeuroShard's search: greedy placement inside a grid search over a max-dimension
constraint, inside a beam search over column splits, then a local-improvement pass; before
it, the choice of which tables to replicate (data-parallel) or split by rows (row-wise).

One module per stage, in the order a plan passes through them (each module's docstring
says what goes in and what comes out, and why the stage is as it is):

- ``driver``: ``search``, the entry point; a task of several modules planned both whole
  and module by module, the plan the whole step prices lower kept.
- ``joint``: one task's tables planned together: kinds, splits and placement, the
  heuristics' plans as seeds, local improvement.
- ``kinds``: the tables to replicate or split by rows.
- ``splits``: the beam search over column splits.
- ``greedy``: every split state placed greedily at every max-dimension scale, in lockstep.
- ``local``: moves and swaps of shards off the bottleneck device.
- ``modules``: planning module by module; moves and swaps off each module's slowest device.
- ``fixed``: what placements fixed before a stage leave and cost; ``config``: the knobs,
  the result and what the stages share.
"""

from torchrec_neuroshard.search.config import SearchConfig, SearchResult, default_scales
from torchrec_neuroshard.search.driver import predicted_breakdown, search

__all__ = ["SearchConfig", "SearchResult", "default_scales", "predicted_breakdown", "search"]
