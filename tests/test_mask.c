#include "test.h"
const char *test_suite_name = "mask";
const test_case test_suite[] = {{0, 0}};
