"""Protocol buffer definitions; generated modules are written next to the .proto files."""
