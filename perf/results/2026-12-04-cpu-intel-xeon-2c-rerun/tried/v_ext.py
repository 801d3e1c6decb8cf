# A top-1 chain grown below the static tree's likeliest deepest node while its path probability stays >= a threshold
# (up to 3 nodes, one head forward each), merged and verified with the rest; the node budget grows by 3.
"""experiment: extend the static tree's most likely deepest path by a top-1 chain while its path prob stays >= THR"""
import math, functools, torch
from runtime.drafters import eagle, merged
from runtime.drafters.eagle import DraftTreeCache, _kept_subtree
from runtime.protocol import Draft, Proposal
from runtime.tree import Tree
CFG = {'ext': 0, 'thr': 0.5}

@functools.lru_cache(maxsize=4096)
def _with_chain(tree, start, k):
    base = tree.choices[start - 1] if start else ()
    return Tree.from_choices(list(tree.choices) + [base + (0,) * j for j in range(1, k + 1)])

def _draft_static(self, root, root_out, max_nodes):
    device = root_out.device
    tree, plan = self._static_plan(max_nodes, device)
    tokens = torch.full((tree.num_nodes,), root, dtype=torch.int64, device=device)
    if plan is None:
        return Draft(tree, tokens.cpu(), Proposal.DETERMINISTIC)
    min_score = self.drafter.min_score
    scores = torch.full((tree.num_nodes,), -math.inf, device=device); scores[0] = 0.0
    out = torch.empty(tree.num_nodes, root_out.shape[0], dtype=root_out.dtype, device=device)
    out[0] = root_out
    self._fill_children(plan.root, out, tokens, scores)
    ext = CFG['ext']
    self._reserve(plan.forwarded + ext)
    step = DraftTreeCache(self.head, self.cache)
    base = step.base
    block = []
    chain_tok, chain_sc = [], []
    start = None
    try:
        stopped = False
        for level in plan.levels:
            if bool((scores[level.new] < min_score).all()):
                stopped = True
                break
            out[level.new] = step.forward(self._embed(tokens[level.new]), out[level.parents], base + level.offsets, level.visible)
            block += level.new.tolist()
            self._fill_children(level.expand, out, tokens, scores)
        if ext and not stopped:
            depth = tree.depth
            deepest = (depth == tree.max_depth).nonzero().flatten()
            best = int(deepest[int(torch.argmax(scores[deepest]))])
            thr = math.log(CFG['thr'])
            if float(scores[best]) >= thr:
                start = best
                cur, cur_tok, cur_sc = best, tokens[best], float(scores[best])
                parent_out = out[tree.parent_list[best]]
                anc = tree.mask[best][block].tolist() if block else []
                d = int(depth[best])
                for j in range(ext):
                    visible = torch.tensor([anc + [True]], dtype=torch.bool, device=device)
                    o = step.forward(self._embed(cur_tok.view(1)), parent_out[None], torch.tensor([base - 1 + d], device=device), visible)
                    lp = self._logprobs(o)[0]
                    v, i = torch.max(lp, dim=-1)
                    s = cur_sc + min(float(v), 0.0)
                    if s < thr:
                        break
                    t = self.drafter.to_target(i.view(1))[0]
                    chain_tok.append(int(t)); chain_sc.append(s)
                    anc = anc + [True]; parent_out = o[0]; cur_tok = t; cur_sc = s; d += 1
    finally:
        step.close()
    if chain_tok:
        big = _with_chain(tree, start, len(chain_tok))
        base_path = tree.choices[start - 1]
        tok_of = {(): root}; sc_of = {(): 0.0}
        tl, sl = tokens.tolist(), scores.tolist()
        for i, p in enumerate(tree.choices, 1): tok_of[p] = tl[i]; sc_of[p] = sl[i]
        for j, (t, s) in enumerate(zip(chain_tok, chain_sc), 1):
            tok_of[base_path + (0,) * j] = t; sc_of[base_path + (0,) * j] = s
        tree = big
        tokens = torch.tensor([root] + [tok_of[p] for p in big.choices], dtype=torch.int64)
        scores = torch.tensor([0.0] + [sc_of[p] for p in big.choices], dtype=torch.float32)
    keep = (scores >= min_score).nonzero().flatten().cpu()
    return Draft(_kept_subtree(tree, tuple(keep.tolist())), tokens.cpu()[keep], Proposal.DETERMINISTIC, scores=scores.cpu()[keep])

eagle.EagleSession._draft_static = _draft_static
_nb = merged.MergedDrafter.node_budget
merged.MergedDrafter.node_budget = lambda self, m: min(m, _nb(self, m) + CFG['ext'])

def setter(ext, thr):
    def f(): CFG['ext'] = ext; CFG['thr'] = thr
    return f

def make(target, base, build_decoder):
    d = build_decoder(target, base)[0]
    return {'plain': (build_decoder(target, None)[0], None), 'static': (d, setter(0, 0.5)),
            'ext3@0.5': (d, setter(3, 0.5)), 'ext3@0.3': (d, setter(3, 0.3))}
