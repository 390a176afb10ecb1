"""TensorFlow's ``tf.distribute`` Strategy API on torch, a thin adapter over ``tm.DataParallel``.

>>> import torch
>>> from trainmesh.strategy import MirroredStrategy, ReduceOp, compute_average_loss
>>> strategy = MirroredStrategy()                 # one replica per process of the job
>>> with strategy.scope():
...     model = torch.nn.Linear(8, 2)             # parameters mirrored across replicas
...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
>>> global_batch_size = 16 * strategy.num_replicas_in_sync
>>> def train_step(x, y):
...     per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
...     loss = compute_average_loss(per_example, global_batch_size=global_batch_size)
...     optimizer.zero_grad()
...     loss.backward()
...     optimizer.step()                          # gradients SUMmed over replicas first
...     return loss.detach()
>>> batches = [(torch.randn(global_batch_size, 8), torch.randint(0, 2, (global_batch_size,)))]
>>> for x, y in strategy.experimental_distribute_dataset(batches):
...     loss = strategy.reduce(ReduceOp.SUM, strategy.run(train_step, args=(x, y)))
"""

from .input import InputContext
from .losses import compute_average_loss
from .mirrored import MirroredStrategy, MultiWorkerMirroredStrategy
from .reduce import ReduceOp

__all__ = [
    "InputContext",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "ReduceOp",
    "compute_average_loss",
]
