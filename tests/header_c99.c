/* The public header must compile on its own as strict C99: -std=c99 -pedantic -Werror -Wall -Wextra. */
#include <cuvmm.h>

int main(void)
{
	return 0;
}
