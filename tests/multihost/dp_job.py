"""A tiny fixed-data training job for the multi-host parity tests (run through `trainmesh run`).

It trains three times in one launch, so process start-up is paid once: the same model under
``tm.DataParallel()`` (DDP) and under ``tm.DataParallel(zero_stage=3)`` (FSDP2), and an MLP
under a tensor layout (``tm.ModelParallel``, mesh ``data x model`` = 2 x 2, its hidden layer
column/row sharded on ``model``). The main process saves each run's full final parameters;
every process records where it ran.
"""

import argparse
import json
import os

import torch

import trainmesh as tm

N, GLOBAL_BATCH, EPOCHS = 64, 16, 2  # 8 steps


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(16, 64)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(2)])
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(16, 64)
        self.down = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def tensor_layout():
    mesh = tm.DeviceMesh((2, 2), ["data", "model"], devices=tm.list_devices())
    layout_map = tm.LayoutMap(mesh)
    layout_map["up.weight"] = ("model", None)
    layout_map["up.bias"] = ("model",)
    layout_map["down.weight"] = (None, "model")
    return tm.ModelParallel(layout_map=layout_map, batch_dim_name="data")


RUNS = {
    "dp": (Net, tm.DataParallel),
    "zero3": (Net, lambda: tm.DataParallel(zero_stage=3)),
    "layout": (Mlp, tensor_layout),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of " + ",".join(RUNS))
    args = parser.parse_args()
    cluster = tm.initialize()
    torch.set_num_threads(1)
    with open(os.path.join(args.out, f"rank{cluster.rank}.json"), "w") as fh:
        json.dump(
            {
                "rank": cluster.rank,
                "world_size": cluster.world_size,
                "node_rank": cluster.node_rank,
                "master_addr": cluster.master_addr,
                "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            },
            fh,
        )
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(N, 16, generator=g), torch.randn(N, 4, generator=g))
    for name in args.runs.split(","):
        model_class, distribution = RUNS[name]
        model = model_class()
        trainer = tm.Trainer(
            model,
            torch.optim.Adam(model.parameters(), lr=1e-2),
            torch.nn.MSELoss(),
            distribution=distribution(),
            progress=False,
        )
        trainer.fit(data, epochs=EPOCHS, batch_size=GLOBAL_BATCH)
        final = trainer.state_dict()["model"]
        if tm.is_main_process():
            torch.save(final, os.path.join(args.out, f"final_{name}.pt"))
    tm.shutdown()


if __name__ == "__main__":
    main()
