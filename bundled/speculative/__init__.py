"""The bundled speculative decoding methods (``speculative_config``'s ``method``): ``ngram``,
prompt lookup over the request's own prompt and output (:mod:`hookllm.spec.ngram`), and
``draft_model``, a small model of the same tokenizer (:mod:`hookllm.spec.draft_model`), and
``eagle3``, an EAGLE-3 head over the target's features (:mod:`hookllm.spec.eagle`). Found by
name: no ``--plugin`` needed."""

from hookllm import hookimpl
from hookllm.spec.proposer import SpecProposers


@hookimpl
def register_spec_proposers(proposers: SpecProposers) -> None:
    from hookllm.spec.draft_model import DraftModelProposer
    from hookllm.spec.eagle import Eagle3Proposer
    from hookllm.spec.ngram import NgramProposer

    proposers.add("ngram", NgramProposer)
    proposers.add("draft_model", DraftModelProposer)
    proposers.add("eagle3", Eagle3Proposer)
