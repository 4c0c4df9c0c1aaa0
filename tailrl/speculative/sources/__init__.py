"""Draft sources: where drafts come from. One protocol (``base.DraftSource``): ``propose`` a
chain or a tree for a request, ``observe`` its new tokens. Suffix-index sources: ``history``
(previous epochs' responses to the prompt), ``group`` (live siblings), ``self`` (the request's
own prompt and output); and ``drafter``, TLT's learned drafter as a source."""
