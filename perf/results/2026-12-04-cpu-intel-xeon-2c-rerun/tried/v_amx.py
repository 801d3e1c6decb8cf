# Side by side with the AMX route of the tree-attention kernel (amx_route.patch applied): each route decodes plain and
# speculative; outputs are identical within a route (the routes round differently, so texts differ across them).
from plugins.tree_attention import native
def route(on):
    def f(): native.load().set_amx(on)
    return f
def make(target, base, build_decoder):
    plain = build_decoder(target, None)[0]
    spec = build_decoder(target, base)[0]
    return {'plain-dp': (plain, route(False)), 'spec-dp': (spec, route(False)),
            'plain-amx': (plain, route(True)), 'spec-amx': (spec, route(True))}
