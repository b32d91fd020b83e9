"""Refit ``workloads.REUSE_MIXTURE``: which access models the synthetic pool's tables use.

For every candidate component c = (alpha, active_ratio), sum over the pool's tables (their
real rows and pooling factors, full size, batch 65,536) the expected histogram weighted by
expected unique ids: V_c. Non-negative least squares finds the mix of normalised V_c that
reproduces the published reuse histogram; a table's probability of drawing c is
proportional to m_c / |V_c|. Prints the constant to paste into workloads.py.

    python -m studies.fit_reuse_mixture
"""

from __future__ import annotations

import itertools

import numpy as np
from scipy.optimize import nnls

from torchrec_neuroshard.access import expected_access_histogram, expected_unique
from torchrec_neuroshard.lab.workloads import DLRM_BATCH_SIZE, DLRM_REUSE_HISTOGRAM, synthetic_pool

ALPHAS = (0.0, 0.3, 0.6, 0.9, 1.2)
RATIOS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def main() -> None:
    pool = synthetic_pool()
    components = list(itertools.product(ALPHAS, RATIOS))
    columns = []
    for alpha, ratio in components:
        v = np.zeros(len(DLRM_REUSE_HISTOGRAM))
        for t in pool:
            lookups = t.pooling_factor * DLRM_BATCH_SIZE
            h = np.asarray(expected_access_histogram(t.rows, lookups, alpha, ratio))
            v += h * expected_unique(t.rows, lookups, alpha, ratio)
        columns.append(v)
    V = np.stack(columns, axis=1)
    norms = V.sum(axis=0)
    target = np.asarray(DLRM_REUSE_HISTOGRAM)
    # The extra row pins sum(m) = 1 (a distribution over components).
    A = np.vstack([V / norms, 10 * np.ones(len(components))])
    m, _ = nnls(A, np.concatenate([target, [10.0]]))
    print("fitted aggregate:", np.round((V / norms) @ m, 3))
    print("REUSE_MIXTURE = (")
    for (alpha, ratio), mc, n in zip(components, m, norms):
        if mc > 1e-4:
            print(f"    ({alpha}, {ratio}, {mc / n * 1e9:.4f}),")
    print(")")


if __name__ == "__main__":
    main()
