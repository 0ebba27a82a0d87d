"""The evaluator chain (docs/protocol.md, "Evaluators"): one ``Evaluator`` interface, several strategies —
builtin (in-process KRM functions), exec (cached binaries), pod (wrapper servers) — and the
multi-evaluator that tries them in order, falling through only on ``NotFoundError``."""
