"""Predicted against measured whole-model time, for every plan a tune times end to end.

kselect chooses among plans on summed isolated times: each op's config timed alone, plus the
conversions the planner counts between ops (``summed_us``). A sum leaves out the ops no library
tunes (pools, adds, reshapes, run as the runtime runs them) and the time between ops, so it is
no whole-model time by itself. It is turned into one through a reference plan timed in the same
race (ONNX Runtime's default session, a library's default, the fp32 plan of a precision front):
a plan is predicted at the reference's measured time plus the difference of the two sums. The
error of that prediction (predicted / measured - 1) is then the error of the difference the
planner ranks plans by, which is what a tune should be judged on. A front whose costs were
corrected in context (core/whole_model/context.py) has whole-model figures: a point is predicted
at the fp32 plan's measured time times the ratio of their figures.
"""

from __future__ import annotations

from kselect.core.plans.plan import ISOLATED_US, PREDICTED_BASIS, PREDICTED_US
from kselect.core.whole_model.context import IN_CONTEXT


def summed_us(plan) -> tuple[float, str]:
    """A plan's summed time, us, and what it covers: "ops and conversions" when the planner that
    made the plan counted its conversions (plans with layouts or libraries per op, precision front
    points), corrected in context where the front learned its costs in whole runs
    (core/whole_model/context.py), else "ops" (its op configs' isolated times alone)."""
    if PREDICTED_US in plan.extra:
        return float(plan.extra[PREDICTED_US]), plan.extra.get(PREDICTED_BASIS, "ops and conversions")
    return plan.estimated_us(), "ops"


def isolated_us(plan) -> float:
    """A plan's summed isolated time, us: the sum a figure in context was corrected from, else its
    figure."""
    plan_us, basis = summed_us(plan)
    return float(plan.extra[ISOLATED_US]) if basis == IN_CONTEXT and ISOLATED_US in plan.extra else plan_us


def predicted_ms(plan, reference_plan, reference_ms: float) -> float:
    """The whole-model time predicted for ``plan`` from ``reference_plan``'s measured time: scaled
    by the ratio of their figures where both are whole-model times corrected in context (a run
    timed per node and the race's fresh processes differ by a factor), else plus the difference
    of their isolated sums (a sum leaves the untuned ops out, so a whole-model figure is never
    set against a sum)."""
    (plan_us, plan_basis), (reference_us, reference_basis) = summed_us(plan), summed_us(reference_plan)
    if plan_basis == reference_basis == IN_CONTEXT and reference_us > 0:
        return reference_ms * plan_us / reference_us
    return by_sums(isolated_us(plan), isolated_us(reference_plan), reference_ms)


def by_sums(plan_sum_us: float, reference_sum_us: float, reference_ms: float) -> float:
    """The reference's measured time plus the difference of the two sums; their ratio where the
    sums lie further apart than the reference's whole run (a noisy default timing among them)."""
    by_difference = reference_ms + (plan_sum_us - reference_sum_us) / 1000
    if by_difference > 0 or reference_sum_us <= 0:
        return by_difference
    return reference_ms * plan_sum_us / reference_sum_us


def prediction(plan, reference: str, reference_plan, reference_ms: float, measured_ms: float) -> dict:
    """The JSON figure a tune stores beside a plan's end-to-end measurement."""
    predicted = predicted_ms(plan, reference_plan, reference_ms)
    summed, covers = summed_us(plan)
    figure = {"reference": reference, "summed_ms": round(summed / 1000, 4), "summed_covers": covers,
              "predicted_ms": round(predicted, 4), "measured_ms": round(measured_ms, 4),
              "error": round(predicted / measured_ms - 1, 4)}
    if ISOLATED_US in plan.extra and ISOLATED_US in reference_plan.extra:
        # the same prediction from the isolated sums the context corrected: what the correction changed
        isolated = by_sums(plan.extra[ISOLATED_US], reference_plan.extra[ISOLATED_US], reference_ms)
        figure.update({"isolated_predicted_ms": round(isolated, 4), "isolated_error": round(isolated / measured_ms - 1, 4)})
    return figure
