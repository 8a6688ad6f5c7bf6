import timeit
from iquest.kernels import fp8_linear_direct as fd
uncached = fd.load_layout.__wrapped__
print("load_layout(2) uncached: %.2f us a call" % (timeit.timeit(lambda: uncached(2), number=20000) / 20000 * 1e6))
print("load_layout(2) cached:   %.3f us a call" % (timeit.timeit(lambda: fd.load_layout(2), number=20000) / 20000 * 1e6))
