from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0016_shard_slot_queue"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="prefix_groups",
            field=models.PositiveIntegerField(
                default=0,
                help_text="Prefix groups the planner kept together; 0: each shard holds consecutive records.",
            ),
        ),
    ]
