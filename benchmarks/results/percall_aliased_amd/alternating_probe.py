import time, numpy as np, jax, jax.numpy as jnp, polymask as pm
f = lambda x: jnp.sum(x * x)
pj = pm.jit(f, in_specs=("n",))
jj = jax.jit(f)
xn = np.arange(100, dtype=np.float32); xa = jnp.asarray(xn)
def t(fn, x, n=20000):
    for _ in range(200): fn(x)
    best = 1e9
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n): fn(x)
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6
for name, fn in [("pm", pj), ("jj", jj)]:
    for xin, x in [("np", xn), ("arr", xa)]:
        print(name, xin, round(t(fn, x), 2))
# components
print("asarray", round(t(np.asarray, xa), 2))
info = next(iter(pj._fast.values()))
entry = info.entry
fn, sizes = entry.fn, info.sizes
print(type(fn), fn)
xp = np.zeros(128, np.float32); xp[:100] = xn
xpa = jnp.asarray(xp)
print("fn np padded", round(t(lambda x: fn(x, sizes), xp), 2))
print("fn arr padded", round(t(lambda x: fn(x, sizes), xpa), 2))
print("pad_one arr", round(t(info.pad_one, xa), 2))
print("pad_one np", round(t(info.pad_one, xn), 2))
jj2 = jax.jit(lambda x, s: (jnp.sum(x*x),))
print("jj2 arr + sizes", round(t(lambda x: jj2(x, sizes), xpa), 2))
print("jj1 arr padded", round(t(jj, xpa), 2))
