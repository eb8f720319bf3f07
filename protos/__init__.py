"""Protocol buffer definitions of the service API (protos/llm/v1/llm.proto).

Generated modules live next to the .proto files; create them with `python -m protos.generate`.
"""
