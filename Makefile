# Shortcuts around CMake; the real build description is CMakeLists.txt.
.PHONY: all setup run test bench clean
all setup:
	bash scripts/setup.sh
run: setup
	./build/kvcache run --chat -p "What is the capital of France?"
bench: setup
	./build/kvcache bench
test:
	bash scripts/test.sh
clean:
	rm -rf build build-asan build-fuzz
