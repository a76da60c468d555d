"""The pass registry and MatchPass's loop (issue 52, item 6): every registered pass is in the
default order or named opt-in with a reason, and a rewrite that erases a node later in the
graph's order never has it handed to `match`."""

import torch

from metainfer import passes
from metainfer.passes.base import MatchPass, PassContext
from metainfer.passes.pipeline import DEFAULT_ORDER, OPT_IN
from metainfer.hardware import targets


def test_every_registered_pass_is_in_the_default_order_or_opt_in():
    registered = set(passes.pass_names())
    assert len(DEFAULT_ORDER) == len(set(DEFAULT_ORDER)), "a pass listed twice in DEFAULT_ORDER"
    assert not set(DEFAULT_ORDER) & set(OPT_IN), "a pass both default and opt-in"
    assert registered == set(DEFAULT_ORDER) | set(OPT_IN), (
        f"not placed: {sorted(registered - set(DEFAULT_ORDER) - set(OPT_IN))}; "
        f"placed but not registered: {sorted((set(DEFAULT_ORDER) | set(OPT_IN)) - registered)}")
    assert all(why.strip() for why in OPT_IN.values()), "an opt-in pass without its reason"


class _FoldNegPairs(MatchPass):
    """neg(neg(x)) -> x, matched at the first neg: the rewrite erases the second, which comes
    later in the order the loop walks."""

    name = "test_fold_neg_pairs"

    def __init__(self):
        self.seen = []

    def match(self, node, state):
        self.seen.append(node)
        if node.op == "call_function" and node.target is torch.ops.aten.neg.default:
            users = list(node.users)
            if len(users) == 1 and users[0].target is torch.ops.aten.neg.default:
                return users[0]
        return None

    def rewrite(self, node, site, state):
        site.replace_all_uses_with(node.args[0])
        state.graph.erase_node(site)
        state.graph.erase_node(node)

    def describe(self, node, site):
        return f"{node.name}: neg pair folded"


def test_match_pass_never_hands_an_erased_node_to_match():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    first = g.call_function(torch.ops.aten.neg.default, (x,))
    second = g.call_function(torch.ops.aten.neg.default, (first,))
    g.output(g.call_function(torch.ops.aten.relu.default, (second,)))
    p = _FoldNegPairs()
    res = p.run(g, PassContext(target=targets.get("cpu")))
    assert res.matches == 1 and [n.target for n in g.nodes if n.op == "call_function"] == [torch.ops.aten.relu.default]
    assert second not in p.seen and [n.op for n in p.seen] == ["placeholder", "call_function", "call_function", "output"]
