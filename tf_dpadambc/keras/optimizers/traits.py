"""What an optimizer class declares about its privatization, in one place.

Every :class:`~.base.DPOptimizer` subclass has ``TRAITS``, an
:class:`EstimatorTraits`; the shell reads nothing else to decide what to
build, what to refuse and how to account. Adding a variant is one file:

1. subclass an adaptive family and an estimator (``adaptive.py``,
   ``estimators.py``) or :class:`~.base.DPOptimizer` itself;
2. if it releases anything but the Gaussian mean of the plain clipped sum,
   override ``_privatize(ctx, clipped_sum, clipped_square_sum, num_units)``
   and return a :class:`~tf_dpadambc.privatizer.Release`; draw every noise
   with ``ctx.sample(templates, stddev, stream)`` from a stream declared in
   ``noise_streams`` (so the noise comes from the secret seed and is never
   drawn twice);
3. declare ``TRAITS = EstimatorTraits(...)`` with what it does (below), e.g.
   ``TRAITS = EstimatorTraits(releases_plain_sum=False, noise_streams=(0, 1))``;
4. register it with ``@base.register(args_doc)`` (Keras serialization, and
   the shared ``Args`` text appended to the docstring).

``tests/test_variants.py`` then runs it through the shared checks (noise
drawn once, privacy unchanged by saving, accounting).
"""
import dataclasses

from tf_dpadambc.core import diagnostics as core_diagnostics


@dataclasses.dataclass(frozen=True)
class EstimatorTraits:
  """The privacy-relevant facts of one optimizer class.

  Attributes:
    diagnostics: names (``core.diagnostics.NAMES``) of the per-step
      diagnostics ``update_step`` reports.
    noise_streams: the independent noise streams a release draws (0: ḡ;
      1: IME's ḡ²; 2: JME's square sum); each gets its own seed and state.
    uses_square_sum: the release needs Σ_u clip(g_u)² (JME): the train step
      materializes per-unit gradients.
    needs_noise_variance: the update subtracts Φ (bias correction), so the
      noise std of the release must be known.
    releases_plain_sum: the release is the Gaussian mean of the plain clipped
      sum, so a DPQuery can stand in for it (False for IME, JME, STP, DP²,
      public preconditioners, the non-private baseline).
    poisson_unsupported: why Poisson batches (``expected_batch_size``) are
      refused, or None.
    not_private_reason: set by research baselines that apply un-noised
      statistics: why they have no ε.
    accounting_noise_factor: ratio of the σ the accounting may use to the
      configured σ (< 1 where a release has more sensitivity than its noise
      pays for: JME under replace-one, whose ``traits`` property says so).
  """

  diagnostics: tuple = ()
  noise_streams: tuple = (0,)
  uses_square_sum: bool = False
  needs_noise_variance: bool = False
  releases_plain_sum: bool = True
  poisson_unsupported: str = None
  not_private_reason: str = None
  accounting_noise_factor: float = 1.0

  def extend(self, **changes):
    """A copy with ``changes``; ``diagnostics`` add to the inherited ones."""
    added = tuple(changes.pop("diagnostics", ()))
    unknown = set(added) - set(core_diagnostics.NAMES)
    if unknown:
      raise ValueError(f"Unknown diagnostics {sorted(unknown)}: name them in "
                       "core.diagnostics.NAMES.")
    return dataclasses.replace(self, diagnostics=self.diagnostics + added,
                               **changes)
