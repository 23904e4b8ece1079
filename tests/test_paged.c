#include "test.h"
const char *test_suite_name = "paged";
const test_case test_suite[] = {{0, 0}};
