"""What is here: GPU devices and the installed kernels (``devices``), version strings, the memory
budget, ComfyUI's allocation compiler, the measured kernel table."""
