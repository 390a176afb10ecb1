"""The Keras distribution guide's DataParallel program, on PyTorch.

    trainmesh run -n 4 examples/keras_data_parallel.py

Weights are replicated on every process; each global batch of 16 is split over the
processes and gradients are averaged (DistributedDataParallel underneath).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import trainmesh as tm  # noqa: E402
from seed_model import fit_and_evaluate  # noqa: E402


def main() -> None:
    tm.initialize()
    devices = tm.list_devices()
    if tm.is_main_process():
        print(f"DataParallel over {len(devices)} devices: {devices}")
    # As a shortcut, the devices can be skipped: DataParallel() uses every process.
    data_parallel = tm.DataParallel(devices=devices)
    tm.set_distribution(data_parallel)
    fit_and_evaluate(tm.distribution())
    tm.shutdown()


if __name__ == "__main__":
    main()
