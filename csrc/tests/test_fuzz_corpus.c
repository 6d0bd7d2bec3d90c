/*
 * test_fuzz_corpus.c — runs every file of the fuzzer's seed corpus and crash reproducers
 * (csrc/tests/fuzz_corpus/, or the directory given as argv[1]) through fuzz_api.c's
 * LLVMFuzzerTestOneInput, without libFuzzer: a regression test in `make test-c` and under the
 * sanitizers. A failing input aborts with its description. Last line: "N passed, 0 failed".
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>

#include "fuzz_api.c"

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "csrc/tests/fuzz_corpus";
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "cannot open corpus directory %s (run from the repository root)\n", dir);
        printf("0 passed, 1 failed\n");
        return 1;
    }
    int passed = 0;
    struct dirent *ent;
    static uint8_t buf[1 << 16];
    while ((ent = readdir(d)) != NULL) {
        if (ent->d_name[0] == '.') continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, ent->d_name);
        FILE *f = fopen(path, "rb");
        if (!f) continue;
        const size_t n = fread(buf, 1, sizeof buf, f);
        fclose(f);
        fz_input_name = path;
        LLVMFuzzerTestOneInput(buf, n);
        passed++;
    }
    closedir(d);
    printf("%d passed, 0 failed\n", passed);
    return passed == 0;
}
