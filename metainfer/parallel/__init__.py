"""The multi-rank runtime: a model sharded over a torch.distributed job (DTensor plans, the
target's islands as process groups) and a launcher of N local gloo ranks on 127.0.0.1."""
