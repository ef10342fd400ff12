"""The LLMs that write Doc2Query pairs and answers: backends and reply caches."""
