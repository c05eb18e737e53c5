"""The torch measurements of a training setup, with no training step taken: figures (numbers with
their units), never verdicts; analysis/verdicts/ and thresholds.py judge them. One layer, used by
the probe (child/setup_checks.py, child/train.py), the training callbacks (integrations/setup_lint.py)
and the data lint (lint.py, through doctor.data_lint):

  numerics.py      dropout off for a measurement, and the fp32 reference a floor is measured against
  packing.py       packing isolation: a packed forward against each segment run alone
  accumulation.py  the Trainer's micro-batch loss, and the accumulated gradient against the full batch's
  reach.py         trainable groups one backward leaves without a gradient, and untrained embedding rows
  lint.py          the data lint's model (the user's class, as a probe trains it) and its measured checks

Each check compares with a baseline that cannot share the fault it looks for, and measures its own
rounding floor against fp32 (numerics.in_fp32), so that a check can fail in any precision.
"""
