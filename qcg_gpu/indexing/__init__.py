"""Building an index: documents to chunks, Doc2Query pairs, nodes and the kNN graph."""
