"""Draft sources: models, n-gram tables, prompt lookup, suffix tries, remote and cross-vocabulary drafts."""
