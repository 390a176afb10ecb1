"""The Keras distribution guide's ModelParallel program, on PyTorch.

    trainmesh run -n 4 examples/keras_model_parallel.py            # 2x2 mesh
    trainmesh run -n 4 examples/keras_model_parallel.py --mesh 1x4 # all model parallel

``d1.weight`` is sharded over the "model" axis (torch stores it as (out, in), so Keras'
kernel layout (None, "model") is ("model", None) here); ``d2/output`` is laid out as
("data", None); data is split over "data". Change the mesh, nothing else.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import trainmesh as tm  # noqa: E402
from seed_model import fit_and_evaluate  # noqa: E402


def build_distribution(mesh_shape: tuple[int, int]) -> tm.ModelParallel:
    mesh = tm.DeviceMesh(shape=mesh_shape, axis_names=["data", "model"], devices=tm.list_devices())
    layout_map = tm.LayoutMap(mesh)
    layout_map["d1.weight"] = ("model", None)
    layout_map["d2/output"] = ("data", None)
    return tm.ModelParallel(layout_map=layout_map, batch_dim_name="data")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", default=None, help="data x model, e.g. 2x2 (default: 2 x world/2, or 1x1)")
    args = parser.parse_args()
    tm.initialize()
    world = tm.world_size()
    if args.mesh:
        shape = tuple(int(n) for n in args.mesh.lower().split("x"))
    else:
        shape = (2, world // 2) if world % 2 == 0 else (1, world)
    model_parallel = build_distribution(shape)
    if tm.is_main_process():
        print(f"ModelParallel on a {shape[0]}x{shape[1]} mesh (data x model)")
    tm.set_distribution(model_parallel)
    result = fit_and_evaluate(tm.distribution())
    local_shape = tuple(result["model"].d1.weight.to_local().shape)
    print(f"process {tm.rank()}: local shard of d1.weight {local_shape} of (200, 784)")
    tm.shutdown()


if __name__ == "__main__":
    main()
