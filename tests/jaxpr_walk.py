"""Every equation of a traced program, those of nested jaxprs (loops, conditionals, pjit, shard_map) included: what
the tests that count kernel calls, dot shapes or operand dtypes in a program walk."""

from collections.abc import Iterator

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, jaxprs_in_params


def equations(jaxpr: ClosedJaxpr | Jaxpr) -> Iterator[JaxprEqn]:
    """The program's equations in order, each nested jaxpr's right after the equation holding it."""
    for eqn in (jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr).eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from equations(sub)
