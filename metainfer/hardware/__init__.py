"""The hardware model: targets (what a machine is), the cost model and schedule simulator (what
a graph would take on it), model shapes and the planner (what to run it with). Plain data and
arithmetic over fake tensors: nothing here compiles or runs a model, so passes may ask it."""
