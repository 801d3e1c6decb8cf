# Variant file for ../2026-12-04-cpu-intel-xeon-2c/tried/ab.py: the configured drafter with the drafting bookkeeping
# of 401f1e1 ('old') against this commit's ('new'), in one process. Each variant's setup swaps the functions that
# changed before each of its generate calls: Tree.from_choices (cached trees), the dynamic selection merge_pools
# calls, Datastore.continuation (counting in Python) and the static tree's drafting loop (tokens and scores in lists).
import subprocess
import sys
import types

import runtime.drafters.datastore as DS
import runtime.drafters.eagle as E
import runtime.drafters.merged as M
import runtime.tree as T

BASE = '401f1e1'


def _old_module(path, name):
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(subprocess.check_output(['git', 'show', f'{BASE}:{path}'], text=True), name, 'exec'), module.__dict__)
    return module


old_tree = _old_module('runtime/tree.py', 'old_tree')
old_store = _old_module('runtime/drafters/datastore.py', 'old_datastore')
old_eagle = _old_module('runtime/drafters/eagle.py', 'old_eagle')
old_tree.Tree = T.Tree  # the old selection builds the live Tree class (through whichever from_choices is in place)
METHODS = ('_draft_static', '_fill_children', '_static_plan')


def _old_from_choices(cls, paths, max_depth=None, max_nodes=None):
    return cls(T._normalize_choices(paths, max_depth=max_depth, max_nodes=max_nodes))


def _old_merge_pools(pools, root, max_nodes):
    # 401f1e1's merge_pools with its tensor round trip: the same function body, its select_dynamic_tree the old one
    return _old_merged.merge_pools(pools, root, max_nodes)


_old_merged = _old_module('runtime/drafters/merged.py', 'old_merged')
_old_merged.select_dynamic_tree = old_tree.select_dynamic_tree

NEW = {'from_choices': T.Tree.__dict__['from_choices'], 'merge_pools': M.merge_pools,
       'continuation': DS.Datastore.continuation, **{m: E.EagleSession.__dict__[m] for m in METHODS}}
OLD = {'from_choices': classmethod(_old_from_choices), 'merge_pools': _old_merge_pools,
       'continuation': old_store.Datastore.continuation, **{m: old_eagle.EagleSession.__dict__[m] for m in METHODS}}


def _use(version):
    def setup():
        T.Tree.from_choices = version['from_choices']
        M.merge_pools = version['merge_pools']
        DS.Datastore.continuation = version['continuation']
        for m in METHODS:
            setattr(E.EagleSession, m, version[m])
    return setup


def make(target, base, build_decoder):
    return {'plain': (build_decoder(target, None)[0], _use(NEW)), 'old': (build_decoder(target, base)[0], _use(OLD)),
            'new': (build_decoder(target, base)[0], _use(NEW))}
