"""Multiple-testing corrections shared by the statistical tests (written from the
definitions, independent of the code under test)."""


def holm(pvalues: dict, alpha: float) -> list:
  """The tests Holm's step-down procedure rejects at family-wise level `alpha`, most
  significant first."""
  ranked = sorted(pvalues, key=pvalues.get)
  rejected = []
  for i, name in enumerate(ranked):
    if pvalues[name] > alpha / (len(ranked) - i):
      break
    rejected.append(name)
  return rejected
