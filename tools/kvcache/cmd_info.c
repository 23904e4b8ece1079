/*
 * `kvcache info`: what this build of the library will run with. One
 * "key: value" pair per line so scripts can grep it, e.g. `isa: avx512`.
 */
#include <stdio.h>
#include <stdlib.h>

#include "cli.h"
#include "kvcache/kvcache.h"

static const char info_usage[] =
    "usage: kvcache info\n"
    "\n"
    "Prints one 'key: value' line each:\n"
    "  version         library version\n"
    "  isa             ISA the kernels run with now (kvc_get_isa)\n"
    "  best_isa        best ISA this CPU/OS supports (ignores KVC_ISA)\n"
    "  supported_isas  every ISA this CPU/OS can run\n"
    "  KVC_ISA         the KVC_ISA environment variable ('(unset)' if unset)\n"
    "  cpus            the CPUs this process may run on (its affinity mask)\n"
    "  cpu             CPU model\n";

int cmd_info(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (cli_is_help(argv[i])) {
            fputs(info_usage, stdout);
            return CLI_EXIT_OK;
        }
        return cli_usage_error("info", "unexpected argument '%s'", argv[i]);
    }
    printf("version: %s\n", kvc_version_string());
    printf("isa: %s\n", kvc_isa_name(kvc_get_isa()));
    printf("best_isa: %s\n", kvc_isa_name(kvc_best_isa()));
    printf("supported_isas:");
    for (int i = 0; i < (int)KVC_ISA_COUNT; i++)
        if (kvc_isa_supported((kvc_isa)i)) printf(" %s", kvc_isa_name((kvc_isa)i));
    printf("\n");
    const char *env = getenv("KVC_ISA");
    printf("KVC_ISA: %s\n", env != NULL ? env : "(unset)");
    printf("cpus: %d\n", cli_online_cpus());
    char model[256];
    printf("cpu: %s\n", cli_cpu_model(model, (int)sizeof model));
    return CLI_EXIT_OK;
}
