"""The llm.v1 front door: llm.v1.LLMService over the shared edge (service/api/edge.py)."""
