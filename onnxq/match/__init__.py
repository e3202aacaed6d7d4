"""The pattern language: DFPattern matching and the rewriter that applies rules."""
