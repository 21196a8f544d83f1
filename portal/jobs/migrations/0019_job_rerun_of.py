import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0018_job_provenance"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="rerun_of",
            field=models.ForeignKey(
                blank=True,
                help_text="The job this one re-runs (same input; its comparison report is against that job's output).",
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="reruns",
                to="jobs.job",
            ),
        ),
    ]
