"""torch's flat-tensor all-gather and reduce-scatter, under whichever name this torch has.

torch 2.14 renamed ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` to
``all_gather_single`` and ``reduce_scatter_single`` and warns (a FutureWarning) at every call of
the old names; trainmesh supports torch versions that have only the old ones. Same arguments:
``all_gather_flat(output, input, group=...)``, ``reduce_scatter_flat(output, input, op=..., group=...)``.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
