"""The bundled speculative decoding methods (``speculative_config``'s ``method``): ``ngram``,
prompt lookup over the request's own prompt and output (:mod:`hookllm.spec.ngram`). Found by
name: no ``--plugin`` needed."""

from hookllm import hookimpl
from hookllm.spec.proposer import SpecProposers


@hookimpl
def register_spec_proposers(proposers: SpecProposers) -> None:
    from hookllm.spec.ngram import NgramProposer

    proposers.add("ngram", NgramProposer)
