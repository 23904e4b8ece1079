/* Placeholder suite: replaced by the module's tests. */
#include "test.h"

const char *test_suite_name = "tokenizer";
const test_case test_suite[] = {{0, 0}};
