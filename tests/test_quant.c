#include "test.h"
const char *test_suite_name = "quant";
const test_case test_suite[] = {{0, 0}};
